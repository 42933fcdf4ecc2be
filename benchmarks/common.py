"""Shared by the benchmarks: alternate measurements, medians, a printed table, RESULTS.md."""

import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("DISTSETUP_BENCH_RESULTS", REPO / "benchmarks" / "RESULTS.md"))  # tests redirect it
BIN = Path(sys.executable).parent


def timed_run(argv: list[str], cwd=None, env=None) -> float:
    """Wall seconds of one subprocess run, which must succeed."""
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(map(str, argv))} failed:\n{result.stdout}\n{result.stderr}")
    return elapsed


def rounds(measures: dict, repeats: int) -> dict:
    """Run each measure once per round, in alternation, `repeats` rounds; return name -> its results."""
    samples = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            samples[name].append(measure())
    return samples


def alternate(measures: dict, repeats: int) -> dict:
    """name -> median of its results over alternating rounds (a measure that returns a dict of figures
    gets the median of each)."""
    return {name: median(values) for name, values in rounds(measures, repeats).items()}


def median(values: list):
    if isinstance(values[0], dict):
        return {key: statistics.median(v[key] for v in values) for key in values[0]}
    return statistics.median(values)


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def record(title: str, text: str) -> None:
    """Print the result and append it, with date, machine and command, to benchmarks/RESULTS.md."""
    print(text)
    command = "python " + shlex.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with RESULTS.open("a") as f:
        f.write(f"\n## {title}\n\n{stamp}; {machine()}; `{command}`\n\n{text}\n")


def launch(nproc: int, argv: list) -> str:
    """stdout of `torchrun --standalone` running `argv` in `nproc` processes (the cores shared among them)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *map(str, argv)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout

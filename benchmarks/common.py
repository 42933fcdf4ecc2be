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
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
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


def launch(nproc: int, argv: list, preexec_fn=None) -> str:
    """stdout of `torchrun --standalone` running `argv` in `nproc` processes (the cores shared among them);
    `preexec_fn` runs in the launcher's process before it starts."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    # torchrun as a module: the GPU check's interpreter may have no torchrun script beside it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *map(str, argv)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, preexec_fn=preexec_fn)
    if result.returncode != 0:
        said = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # the trainer's own line
        raise RuntimeError(
            f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n" + "\n".join(said)
        )
    return result.stdout


def add_run_arguments(
    parser, n_layer=4, n_head=4, n_embd=128, block_size=64, micro_batch_size=8, steps=30, precision="fp32"
) -> None:
    """The model, batch, steps and precision that src/train.py and reference_loop.py are both given."""
    for name, default in (
        ("n_layer", n_layer),
        ("n_head", n_head),
        ("n_embd", n_embd),
        ("block_size", block_size),
        ("micro_batch_size", micro_batch_size),
        ("steps", steps),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=precision)


def train_py_argv(a, output_dir: Path, overrides: list[str]) -> list:
    """src/train.py's command line for the run `a` describes (its only checkpoint at the end), plus `overrides`."""
    run = [
        f"model.n_layer={a.n_layer}",
        f"model.n_head={a.n_head}",
        f"model.n_embd={a.n_embd}",
        f"model.block_size={a.block_size}",
        f"training.max_steps={a.steps}",
        f"training.micro_batch_size={a.micro_batch_size}",
        "training.gradient_accumulation_steps=1",
        f"training.precision={a.precision}",
        f"training.checkpoint_interval={10 * a.steps}",
        "training.warmup_steps=0",
        f"training.output_dir={output_dir}",
    ]
    return ["src/train.py", "--config", REPO / "config" / "config.yaml", *run, *overrides]


def reference_argv(backend: str, a) -> list:
    """reference_loop.py's command line for the same run."""
    shape = [
        f"--{name}={getattr(a, name)}"
        for name in ("n_layer", "n_head", "n_embd", "block_size", "micro_batch_size", "steps", "precision")
    ]
    return [REPO / "benchmarks" / "reference_loop.py", f"--backend={backend}", *shape]

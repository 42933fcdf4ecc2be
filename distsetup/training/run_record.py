"""A run's record in its output folder: its checkpoints, metrics.jsonl, TensorBoard's events and summary.json.

A run started afresh (--no_resume) sets the previous run's record aside whole, so neither a later resume nor a plot
mixes the two runs; one that finds no checkpoint to resume (a crash before the first) sets its metrics aside. A run
that resumes step S continues the record from S: the lines of the steps after S, which a run that crashed past its
last checkpoint wrote and this run repeats, are removed (TensorBoard hides its own events of those steps:
`purge_step`), so each step is in metrics.jsonl once, with the values of the run whose weights go on.
"""

import json
import os
import time
from pathlib import Path

CHECKPOINTS, METRICS, TENSORBOARD, SUMMARY = "checkpoints", "metrics.jsonl", "tensorboard", "summary.json"
RECORD = (CHECKPOINTS, METRICS, TENSORBOARD, SUMMARY)
METRICS_AND_SUMMARY = (METRICS, TENSORBOARD, SUMMARY)  # the record but its checkpoints


def set_aside(out_dir: Path, names: tuple[str, ...] = RECORD) -> Path | None:
    """The previous run's record in `out_dir` (its `names`) moved into out_dir/previous-TIME (None: there was
    none). An empty file, a start that failed before its first line, records nothing: removed, not kept aside."""
    present = [out_dir / name for name in names if (out_dir / name).exists()]
    for empty in [path for path in present if path.is_file() and path.stat().st_size == 0]:
        empty.unlink()
        present.remove(empty)
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out_dir / f"previous-{stamp}", 1
    while aside.exists():  # two fresh starts within a second
        n += 1
        aside = out_dir / f"previous-{stamp}-{n}"
    aside.mkdir()
    for path in present:
        path.rename(aside / path.name)
    return aside


# The run (a SLURM job, a torchrun run) that last started afresh here (--no_resume), once it has set the previous
# run's record aside: its restarts resume, with the same command line, what it wrote since
FRESH_START = ".fresh_start"


def note_fresh_start(out_dir: Path, run: str | None) -> None:
    """Rank 0's note that `run` (launch_env.run_identity; None: a run nothing restarts) started afresh here."""
    marker = out_dir / FRESH_START
    if run is None:
        marker.unlink(missing_ok=True)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(run + "\n")


def started_afresh_here(out_dir: Path, run: str | None) -> bool:
    """Whether `run` is the one that last started afresh in `out_dir` (and set the previous record aside)."""
    marker = out_dir / FRESH_START
    return run is not None and marker.is_file() and marker.read_text().strip() == run


def continue_metrics(path: Path, step: int) -> int:
    """metrics.jsonl made the record of a run that goes on from `step`: the lines of later steps removed, and a
    line cut short by a crash (the next line would be glued to it). Returns how many lines were removed."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and (logged := _step_of(line)) is not None and logged <= step]
    if len(kept) < len(lines):
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_text("".join(kept))
        os.replace(staging, path)
    return len(lines) - len(kept)


def evaluations(path: Path) -> list[dict]:
    """The evaluations metrics.jsonl holds (its lines with a val_loss): those of the steps a resumed run did before,
    which summary.json lists with its own."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if isinstance(row, dict) and "val_loss" in row]


def _step_of(line: str) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row.get("step") if isinstance(row, dict) and isinstance(row.get("step"), int) else None

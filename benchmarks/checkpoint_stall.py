"""Benchmark: how long a checkpoint stops training with training.async_checkpoint off and on, and how fast the
checkpoint is written against a raw torch.save of the same number of bytes to the same disk.

src/train.py trains a GPT (about 60M parameters by default) and checkpoints every --interval steps: single (one
process: the state is copied and a thread writes it) and FSDP (2 processes: DCP's async_save), each synchronously
and in the background, alternately in one run. Each run's summary.json lists how long the loop waited at each
checkpoint (checkpoint_stalls): the table shows their median (the wait for the last background write at the end of
a run aside), the median step time (writing in the background slows the steps it overlaps, on a CPU most) and the
synchronous checkpoint's write throughput (its bytes over its stall) beside torch.save of as many bytes into the
same folder, timed in between."""

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import add_run_arguments, launch, median, record, rounds, table, train_py_argv

BACKENDS = {"single": 1, "fsdp": 2}  # backend -> processes


def run_measure(a, backend: str, background: bool, work: Path):
    """A function that trains once, afresh, and returns (median stall, median step seconds, bytes of a checkpoint)."""
    runs = itertools.count()
    overrides = [
        f"distributed.backend={backend}",
        f"training.checkpoint_interval={a.interval}",
        f"training.async_checkpoint={str(background).lower()}",
        "training.log_interval=1000",
    ]

    def measure() -> dict:
        out = work / f"{backend}-{'async' if background else 'sync'}-{next(runs)}"
        launch(BACKENDS[backend], train_py_argv(a, out, overrides))
        summary = json.loads((out / "summary.json").read_text())
        checkpoints = sorted((out / "checkpoints").glob("step_*"))
        stalls = summary["checkpoint_stalls"][: len(checkpoints)]  # the final wait for a background write aside
        return {
            "stall": statistics.median(stalls),
            "step": summary["median_step_seconds"],
            "bytes": sum(f.stat().st_size for f in checkpoints[0].rglob("*") if f.is_file()),
        }

    return measure


def side_by_side(a, backend: str, work: Path) -> dict:
    """The three measures of one round: a synchronous run, a background one, and torch.save of as many bytes as
    the synchronous run's checkpoint."""
    sync = run_measure(a, backend, False, work)
    written: dict = {}

    def sync_then_remember() -> dict:
        written.update(sync())
        return dict(written)

    return {
        "sync": sync_then_remember,
        "async": run_measure(a, backend, True, work),
        "raw": lambda: raw_save_seconds(written["bytes"], work),
    }


def raw_save_seconds(nbytes: int, folder: Path) -> float:
    """Seconds of one torch.save of `nbytes` of float32 tensors (64 MiB each) into `folder`."""
    floats, chunk = nbytes // 4, 16 * 2**20
    tensors = {f"t{i}": torch.rand(min(chunk, floats - start)) for i, start in enumerate(range(0, floats, chunk))}
    start = time.perf_counter()
    torch.save(tensors, folder / "raw.pt")
    seconds = time.perf_counter() - start
    (folder / "raw.pt").unlink()
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    add_run_arguments(parser, n_layer=8, n_head=12, n_embd=768, block_size=64, micro_batch_size=4, steps=16)
    parser.add_argument("--interval", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    rows = []
    for backend in a.backends:
        measures = side_by_side(a, backend, work)
        samples = rounds(measures, a.repeats)
        s, b, raw = median(samples["sync"]), median(samples["async"]), median(samples["raw"])
        rows.append(
            [
                backend,
                s["bytes"] / 2**20,
                s["stall"],
                b["stall"],
                b["stall"] / s["stall"],
                b["step"] / s["step"],
                s["bytes"] / 2**20 / s["stall"],
                s["bytes"] / 2**20 / raw,
                raw / s["stall"],
            ]
        )
    headers = [
        "backend",
        "checkpoint MiB",
        "stall sync s",
        "stall async s",
        "async / sync stall",
        "async / sync step time",
        "write MiB/s",
        "torch.save MiB/s",
        "write / torch.save",
    ]
    text = table(headers, rows)
    text += (
        f"\n\nGPT {a.n_layer} layers x {a.n_embd}, micro-batch {a.micro_batch_size} x {a.block_size} tokens, "
        f"{a.steps} steps, a checkpoint every {a.interval}; medians over {a.repeats} alternating rounds "
        "(stall: the median checkpoint's wait in each run). Stalls and steps come from each run's summary.json; "
        "torch.save writes as many bytes as one checkpoint, of one process, to the same disk."
    )
    record("Checkpoint stall and write throughput", text)


if __name__ == "__main__":
    main()

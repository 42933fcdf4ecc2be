"""Benchmark: peak memory (RSS) of exporting a ZeRO-3 checkpoint written by 2 ranks, against the model's fp32 bytes.

`distsetup checkpoint export` (safetensors, and --format hf's sharded writer is the same one) reads one tensor at a
time from the ranks' memory-mapped partitions; DeepSpeed's own `zero_to_fp32` (safetensors output) runs on the
same checkpoint, side by side. Goal for distsetup: peak RSS at most 1.5x the model's fp32 bytes. A GPT of about
300M parameters trains 1 step under ZeRO-3 on 2 CPU processes to write the checkpoint (a few minutes on 2 cores;
about 12 GB of memory and 4 GB of disk)."""

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BIN, REPO, launch, record, table, train_py_argv


def peak_rss(argv: list) -> tuple[float, float]:
    """(peak resident bytes, wall seconds) of one subprocess run, which must succeed."""
    start = time.perf_counter()
    proc = subprocess.Popen([str(a) for a in argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    output = proc.stdout.read().decode() if proc.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed:\n{output[-3000:]}")
    return usage.ru_maxrss * 1024.0, seconds  # Linux reports kilobytes


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n_layer", type=int, default=24)
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--n_head", type=int, default=16)
    parser.add_argument("--work", type=Path, help="folder for the checkpoint and exports (default: a temp folder)")
    a = parser.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-export-"))
    run = work / "run"
    checkpoints = run / "checkpoints"

    ds_file = work / "zero3.json"
    subprocess.run(
        [BIN / "distsetup", "deepspeed", "--zero_stage", "3", "--micro_batch_size", "1", "--world_size", "2"]
        + ["--optimizer", "none", "-o", ds_file],
        check=True,
        capture_output=True,
    )
    if not any(checkpoints.glob("step_*/COMPLETE")):
        shape = argparse.Namespace(
            n_layer=a.n_layer,
            n_head=a.n_head,
            n_embd=a.n_embd,
            block_size=64,
            micro_batch_size=1,
            steps=1,
            precision="fp32",
        )
        launch(2, train_py_argv(shape, run, ["--deepspeed", ds_file, "distributed.timeout_minutes=30"]))
    (step,) = [p for p in checkpoints.glob("step_*") if (p / "COMPLETE").exists()]

    from distsetup.training.weight_stream import weight_stream

    fp32_bytes = sum(4 * math.prod(shape) for shape, _ in weight_stream(step).shapes.values())
    ours, theirs = work / "distsetup-export", work / "zero_to_fp32"
    for folder in (ours, theirs):
        subprocess.run(["rm", "-rf", folder], check=True)
    distsetup_rss, distsetup_s = peak_rss([BIN / "distsetup", "checkpoint", "export", run, "-o", ours])
    deepspeed_rss, deepspeed_s = peak_rss(
        [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", checkpoints, theirs, "-t", step.name]
        + ["--safe_serialization"]
    )
    rows = [
        ["distsetup checkpoint export", distsetup_rss / 2**30, distsetup_rss / fp32_bytes, distsetup_s],
        ["DeepSpeed zero_to_fp32", deepspeed_rss / 2**30, deepspeed_rss / fp32_bytes, deepspeed_s],
    ]
    text = table(["exporter", "peak RSS GiB", "x model fp32 bytes", "seconds"], rows)
    verdict = "met" if distsetup_rss <= 1.5 * fp32_bytes else "NOT met"
    text += (
        f"\n\nGPT {a.n_layer} layers x {a.n_embd} ({fp32_bytes / 4e6:.0f}M parameters, {fp32_bytes / 2**30:.2f} GiB "
        f"in fp32), ZeRO-3 checkpoint of 2 CPU ranks; both write safetensors. distsetup peak "
        f"{distsetup_rss / fp32_bytes:.2f}x the model's fp32 bytes (goal <= 1.5x: {verdict}); DeepSpeed's "
        f"{deepspeed_rss / distsetup_rss:.2f}x distsetup's. Peak RSS includes the Python interpreter and torch."
    )
    record("Export memory", text)


if __name__ == "__main__":
    main()

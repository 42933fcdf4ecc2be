"""Benchmark: peak memory (RSS) of exporting and converting a ZeRO-3 checkpoint written by 2 ranks, against the
model's fp32 bytes.

`distsetup checkpoint export` (safetensors; --format hf's sharded writer is the same one) and `distsetup checkpoint
convert` (the whole training state: weights and both AdamW moments, 3x the model's fp32 bytes, into single/DDP's
state.pt, FSDP's DCP folders and DeepSpeed's universal folder) read one tensor at a time from the ranks'
memory-mapped partitions. DeepSpeed's own `zero_to_fp32` (safetensors) and `ds_to_universal` run on the same
checkpoint, side by side. The conversions run in a chain (ZeRO-3 -> state.pt -> DCP -> universal -> state.pt),
so each layout is read once. Goal for distsetup: peak RSS at most 1.5x the model's fp32 bytes. A GPT of about 300M
parameters trains 1 step under ZeRO-3 on 2 CPU processes to write the checkpoint (a few minutes on 2 cores; about
12 GB of memory and 12 GB of disk)."""

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
    with tempfile.TemporaryFile() as log:  # a pipe left unread could fill and stop the run
        start = time.perf_counter()
        proc = subprocess.Popen([str(a) for a in argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        log.seek(0)
        output = log.read().decode(errors="replace")
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
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
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

    distsetup = [BIN / "distsetup", "checkpoint"]
    deepspeed_tools = [  # (tool, what it writes, its command line writing into folder `out`)
        ("distsetup checkpoint export", "safetensors", lambda out: [*distsetup, "export", run, "-o", out]),
        (
            "DeepSpeed zero_to_fp32",
            "safetensors",
            lambda out: (
                [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", checkpoints, out, "-t", step.name]
                + ["--safe_serialization"]
            ),
        ),
        (
            "DeepSpeed ds_to_universal",
            "universal folder",
            lambda out: (
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", step]
                + ["--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1"]
            ),
        ),
    ]
    measured = []  # (tool, what it reads, what it writes, peak RSS bytes, seconds)
    for name, writes, argv in deepspeed_tools:
        out = work / "out"
        subprocess.run(["rm", "-rf", out], check=True)
        measured.append((name, "ZeRO-3", writes, *peak_rss(argv(out))))
        subprocess.run(["rm", "-rf", out], check=True)  # up to 4 GB each: one at a time on the disk
    # conversions in a chain, each reading the one before: every layout is read once and written once
    source, reads = run, "ZeRO-3"
    for i, (to, writes) in enumerate(
        (("ddp", "state.pt"), ("fsdp", "DCP folders"), ("deepspeed", "universal folder"), ("ddp", "state.pt"))
    ):
        out = work / f"converted-{i}"
        subprocess.run(["rm", "-rf", out], check=True)
        measured.append(
            (
                f"distsetup checkpoint convert --to {to}",
                reads,
                writes,
                *peak_rss([*distsetup, "convert", source, "--to", to, "-o", out]),
            )
        )
        if source != run:
            subprocess.run(["rm", "-rf", source], check=True)
        source, reads = out, writes
    subprocess.run(["rm", "-rf", source], check=True)

    from distsetup.training.checkpoint.named_state import (
        weight_stream,  # after the runs: this process's size is theirs too
    )

    fp32_bytes = sum(4 * math.prod(shape) for shape, _ in weight_stream(step).shapes.values())
    rows = [[name, *layouts, rss / 2**30, rss / fp32_bytes, seconds] for name, *layouts, rss, seconds in measured]
    text = table(["tool", "reads", "writes", "peak RSS GiB", "x model fp32 bytes", "seconds"], rows)
    ours = [rss for name, _, _, rss, _ in measured if name.startswith("distsetup")]
    verdict = "met" if max(ours) <= 1.5 * fp32_bytes else "NOT met"
    text += (
        f"\n\nGPT {a.n_layer} layers x {a.n_embd} ({fp32_bytes / 4e6:.0f}M parameters, {fp32_bytes / 2**30:.2f} GiB "
        f"in fp32), ZeRO-3 checkpoint of 2 CPU ranks. distsetup's largest peak is {max(ours) / fp32_bytes:.2f}x the "
        f"model's fp32 bytes (goal <= 1.5x: {verdict}). Peak RSS includes the Python interpreter, torch and DeepSpeed."
    )
    record("Checkpoint export and convert memory", text)


if __name__ == "__main__":
    main()

"""Benchmark: the memory and time of the token loss at a large vocabulary, from the whole logits
(training.chunked_loss never) and a slice of the vocabulary at a time (always).

Single-process src/train.py runs of the built-in GPT that differ only in model.vocab_size (131072 and 32768;
micro-batch 2, sequence 1024, fp32, on the CPU): the loss's extra peak is the difference of the two runs' peak
memory (the process's peak RSS) less the difference of their model states (summary.json), in units of the fp32
logits the larger vocabulary adds (2 x 1024 x 98304 x 4 bytes). Beside it, what `distsetup plan` counts for the
same difference (estimates.activation_bytes, at peak), and each run's median step. Rounds alternate."""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, median, record, rounds, table

sys.path.insert(0, str(REPO))
from distsetup.planning.estimates import Workload, activation_bytes  # noqa: E402
from distsetup.planning.models import ModelShape  # noqa: E402

VOCABS = (32768, 131072)
MODES = ("never", "always")

# Runs one child and prints its peak RSS in KiB: each measurement in a process of its own, so that the peak is its.
PEAK_OF_CHILD = (
    "import resource, subprocess, sys\n"
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def run(a, vocab: int, mode: str, work: Path) -> dict:
    out = work / f"{mode}-{vocab}"
    overrides = [
        f"model.vocab_size={vocab}",
        f"model.n_layer={a.n_layer}",
        f"model.n_head={a.n_head}",
        f"model.n_embd={a.n_embd}",
        f"model.block_size={a.seq}",
        "data.num_samples=200",  # 2% of them the validation set: 4 blocks
        f"training.max_steps={a.steps}",
        f"training.micro_batch_size={a.micro_batch_size}",
        "training.precision=fp32",
        f"training.chunked_loss={mode}",
        f"training.checkpoint_interval={10 * a.steps}",
        f"training.output_dir={out}",
    ]
    argv = [sys.executable, "src/train.py", "--config", str(REPO / "config" / "config.yaml"), "--no_resume"]
    result = subprocess.run(
        [sys.executable, "-c", PEAK_OF_CHILD, *argv, *overrides], cwd=REPO, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{mode} at vocabulary {vocab} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "peak": int(result.stdout.split()[-1]) * 1024,
        "states": sum(summary["memory"].values()),
        "step": summary["median_step_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name, default in (("n_layer", 2), ("n_head", 4), ("n_embd", 128), ("seq", 1024), ("micro_batch_size", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-loss-") as tmp:
        measures = {(m, v): (lambda m=m, v=v: run(a, v, m, Path(tmp))) for m in MODES for v in VOCABS}
        results = {key: median(values) for key, values in rounds(measures, a.repeats).items()}
    positions = a.seq * a.micro_batch_size
    logits = 4 * positions * (VOCABS[1] - VOCABS[0])  # the fp32 logits the larger vocabulary adds
    rows = []
    for mode in MODES:
        small, large = results[(mode, VOCABS[0])], results[(mode, VOCABS[1])]
        measured = (large["peak"] - small["peak"]) - (large["states"] - small["states"])
        planned = [
            activation_bytes(
                ModelShape(1, a.n_embd, a.n_layer, a.n_head, vocab),
                Workload("fp32", a.seq, chunked_loss=mode),
                2,
                False,
            )
            for vocab in VOCABS
        ]
        rows.append(
            [
                mode,
                large["peak"] / 2**30,
                measured / logits,
                (planned[1] - planned[0]) / logits,
                large["step"],
                small["step"],
            ]
        )
    never_step, always_step = rows[0][4], rows[1][4]
    text = table(
        [
            "training.chunked_loss",
            f"peak GiB at {VOCABS[1]}",
            "loss's extra peak (x logits)",
            "plan's count (x logits)",
            f"step s at {VOCABS[1]}",
            f"step s at {VOCABS[0]}",
        ],
        rows,
    )
    text += (
        f"\n\nBuilt-in GPT {a.n_layer} x {a.n_embd}, micro-batch {a.micro_batch_size} x sequence {a.seq}, fp32, one "
        f"process; 'x logits' is in units of the fp32 logits that {VOCABS[1]} ids add over {VOCABS[0]} "
        f"({logits / 2**30:.2f} GiB). Sliced/whole step time at {VOCABS[1]}: {always_step / never_step:.3f}; medians "
        f"of {a.repeats} alternating rounds of {a.steps} steps."
    )
    record("Loss memory at a large vocabulary", text)


if __name__ == "__main__":
    main()

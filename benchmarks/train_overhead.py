"""Benchmark 2: src/train.py's steps/s against the plain loops in reference_loop.py, same model, data,
batch and steps, for single, DDP, FSDP full shard and ZeRO-1/2/3 (2 CPU processes), and for a user's own model
(examples/pairwise_scorer under DDP) against the DDP loop written for it by hand (scorer_loop.py). Each pair is run
alternately, and each round's train.py figure is divided by the reference's next to it (the machine's load
drifts between rounds); the ratio reported is the median over rounds. Goal: train.py / reference >= 0.95
at the steady pace (each run's median step: what a long run sees); the whole run's ratio, first step's
one-off costs included, is shown beside it."""

import argparse
import itertools
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import (
    BIN,
    REPO,
    add_run_arguments,
    launch,
    median,
    record,
    reference_argv,
    rounds,
    table,
    train_py_argv,
)

GOAL = 0.95
BACKENDS = ["single", "ddp", "fsdp", "zero1", "zero2", "zero3", "scorer_ddp"]
SCORER = {"steps": 30, "micro_batch_size": 32, "channels": 32, "depth": 4, "image_size": 16, "num_workers": 2}


def figures(result: dict) -> dict:
    per_s = result.get("tokens_per_s") or result["samples_per_s"]
    return {"steady": 1 / result["median_step_seconds"], "whole run": per_s}


def scorer_measures(work: Path) -> dict:
    """The pairwise scorer example under src/train.py and under the hand-written loop, with the same settings."""
    s = SCORER
    train_py = [
        "src/train.py",
        "--config",
        REPO / "examples" / "pairwise_scorer" / "config.yaml",
        "distributed.backend=ddp",
        f"model.args={{channels: {s['channels']}, depth: {s['depth']}}}",
        f"data.args={{pairs: 4096, image_size: {s['image_size']}}}",
        f"data.num_workers={s['num_workers']}",
        f"training.max_steps={s['steps']}",
        f"training.micro_batch_size={s['micro_batch_size']}",
        f"training.checkpoint_interval={10 * s['steps']}",
        f"training.eval_interval={10 * s['steps']}",
        "training.warmup_steps=0",
    ]
    runs = itertools.count()

    def ours() -> dict:
        out = work / f"train-scorer-{next(runs)}"
        launch(2, [*train_py, f"training.output_dir={out}"])
        return figures(json.loads((out / "summary.json").read_text()))

    def theirs() -> dict:
        flags = [f"--{key}={value}" for key, value in s.items()]
        out = launch(2, [REPO / "benchmarks" / "scorer_loop.py", *flags])
        return figures(json.loads(out.strip().splitlines()[-1]))

    return {"train.py": ours, "reference": theirs}


def train_py_measure(backend: str, work: Path, a) -> callable:
    """A function that runs src/train.py once for `backend` and returns its figures (steady, whole run)."""
    dist = {"single": "single", "ddp": "ddp", "fsdp": "fsdp"}.get(backend, "deepspeed")
    overrides = [f"distributed.backend={dist}"]
    if dist == "deepspeed":
        ds = work / f"{backend}.json"
        subprocess.run(
            [
                str(BIN / "distsetup"),
                "deepspeed",
                "--zero_stage",
                backend[-1],
                "--micro_batch_size",
                str(a.micro_batch_size),
                "--lr",
                "1e-3",
                "-o",
                ds,
            ],
            check=True,
            capture_output=True,
        )
        overrides.append(f"distributed.deepspeed_config={ds}")
    runs = itertools.count()

    def measure() -> dict:
        out = work / f"train-{backend}-{next(runs)}"
        launch(1 if backend == "single" else 2, train_py_argv(a, out, overrides))
        return figures(json.loads((out / "summary.json").read_text()))

    return measure


def reference_measure(backend: str, a) -> callable:
    def measure() -> dict:
        out = launch(1 if backend == "single" else 2, reference_argv(backend, a))
        return figures(json.loads(out.strip().splitlines()[-1]))

    return measure


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=4)
    add_run_arguments(parser)
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    rows = []
    for backend in a.backends:
        if backend == "scorer_ddp":
            measures = scorer_measures(work)
        else:
            measures = {"train.py": train_py_measure(backend, work, a), "reference": reference_measure(backend, a)}
        samples = rounds(measures, a.repeats)
        pairs = list(zip(samples["train.py"], samples["reference"], strict=True))
        steady, whole = (
            statistics.median(ours[key] / theirs[key] for ours, theirs in pairs) for key in ("steady", "whole run")
        )
        rows.append(
            [
                backend,
                median(samples["train.py"])["steady"],
                median(samples["reference"])["steady"],
                steady,
                whole,
                "met" if steady >= GOAL else "NOT met",
            ]
        )
    text = table(
        ["backend", "train.py steps/s", "reference steps/s", "ratio", "whole-run ratio", f"goal >= {GOAL}"], rows
    )
    text += (
        f"\n\nGPT {a.n_layer} layers x {a.n_embd}, block {a.block_size}, micro batch {a.micro_batch_size}, "
        f"{a.steps} steps, 2 processes (single: 1); {a.repeats} alternating rounds; fp32 on CPU. steps/s: "
        "median over rounds of each run's median step; ratios: median over rounds of train.py / reference "
        "in the same round; the whole-run ratio is of tokens/s over all steps. scorer_ddp: examples/pairwise_scorer "
        f"({SCORER['channels']} channels x {SCORER['depth']} blocks, {SCORER['image_size']}-pixel images, "
        f"{SCORER['micro_batch_size']} pairs per process, {SCORER['num_workers']} DataLoader workers per process) "
        "against scorer_loop.py, the DDP loop written for it by hand (DataLoader + DistributedSampler)."
    )
    record("Training-loop overhead", text)


if __name__ == "__main__":
    main()

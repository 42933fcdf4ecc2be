"""Benchmark 4 (for a GPU): tokens/s per GPU and MFU of src/train.py with the built-in GPT at about 1B
parameters in bf16 on one GPU (plain, FSDP2 over one rank, DeepSpeed ZeRO-3 over one rank), against the
same model in reference_loop.py's minimal loop. Goal: MFU >= 40%. Each run's peak GPU memory is shown
beside `distsetup plan`'s estimate for it.

MFU = tokens/s x training FLOPs per token / the GPU's dense bf16 peak, with FLOPs per token = 6N + 12 L d T
(N parameters outside the embedding tables, L layers, width d, sequence T: the PaLM paper's appendix B, as
nanoGPT counts). tokens/s comes from each run's median step, so start-up and warm-up are left out.

Without a GPU it runs the same way on the CPU: give a small model and --peak_tflops (tests do this).
"""

import argparse
import itertools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from common import BIN, add_run_arguments, alternate, launch, machine, record, reference_argv, table, train_py_argv

from distsetup.training.model import throughput
from distsetup.training.model.throughput import peak_tflops

GOAL = 0.40
RUNS = ["train.py single", "train.py fsdp", "train.py zero3", "reference loop"]
PLANNED_AS = {
    "train.py single": "ddp",
    "train.py fsdp": "fsdp_full_shard",
    "train.py zero3": "zero3",
    "reference loop": "ddp",
}  # `distsetup plan` strategy for each run (one GPU: DDP is plain)


def parameters(a) -> int:
    return sum(p.numel() for p in gpt_on_meta(a).parameters())


def flops_per_token(a) -> float:
    return throughput.flops_per_token(gpt_on_meta(a), a.block_size)


def gpt_on_meta(a):
    import torch

    from distsetup.training.model.gpt import GPT

    with torch.device("meta"):
        return GPT(256, a.block_size, a.n_layer, a.n_head, a.n_embd, 0.0)


def measure_train_py(run: str, work: Path, a):
    backend = run.split()[-1]
    if backend == "zero3":
        ds = work / "zero3.json"
        precision = ["--bf16"] if a.precision == "bf16" else []
        # --optimizer none: train.py hands DeepSpeed the torch AdamW the other runs use (DeepSpeed's own
        # would be its FusedAdam, compiled on first use with nvcc).
        subprocess.run(
            [
                str(BIN / "distsetup"),
                "deepspeed",
                "--zero_stage",
                "3",
                *precision,
                "--optimizer",
                "none",
                "--micro_batch_size",
                str(a.micro_batch_size),
                "-o",
                ds,
            ],
            check=True,
            capture_output=True,
        )
        overrides = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={ds}"]
    else:
        overrides = [f"distributed.backend={backend}"]
    runs = itertools.count()

    def measure() -> dict:
        out = work / f"{backend}-{next(runs)}"
        launch(1, train_py_argv(a, out, overrides))
        summary = json.loads((out / "summary.json").read_text())
        shutil.rmtree(out)  # the final checkpoint of a 1B model: about 12 GB per run
        return figures(summary, a)

    return measure


def measure_reference(a):
    def measure() -> dict:
        out = launch(1, reference_argv("single", a))
        return figures(json.loads(out.strip().splitlines()[-1]), a)

    return measure


def planned_gb(a) -> dict:
    """`distsetup plan`'s peak per run, less the CUDA runtime it adds (which max_memory_allocated never sees)."""
    plan = subprocess.run(
        [
            str(BIN / "distsetup"),
            "plan",
            "--params",
            str(parameters(a)),
            "--hidden_size",
            str(a.n_embd),
            "--num_layers",
            str(a.n_layer),
            "--num_heads",
            str(a.n_head),
            "--vocab_size",
            "256",
            "--seq_len",
            str(a.block_size),
            "--micro_batch_size",
            str(a.micro_batch_size),
            f"--{a.precision}",
            "--num_gpus",
            "1",
            "--gpu_memory",
            "10TB",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(plan.stdout)
    totals = {e["strategy"]: e["total"] - result["hardware"]["runtime_bytes"] for e in result["estimates"]}
    return {run: totals[strategy] / 1e9 for run, strategy in PLANNED_AS.items()}


def figures(result: dict, a) -> dict:
    """tokens/s at the median step's pace (a step: one micro-batch of one process) and peak GB."""
    return {
        "tokens_per_s": a.micro_batch_size * a.block_size / result["median_step_seconds"],
        "peak_gb": (result.get("peak_device_bytes") or 0) / 1e9,
    }


def device_name() -> str:
    probe = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    return subprocess.run([str(BIN / "python"), "-c", probe], capture_output=True, text=True, check=True).stdout.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(
        parser, n_layer=20, n_head=16, n_embd=2048, block_size=2048, micro_batch_size=4, steps=20, precision="bf16"
    )  # 20 layers x 2048 wide: 1.01B parameters
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--peak_tflops", type=float, help="the device's peak for --precision (default: from the GPU's name for bf16)"
    )
    parser.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    a = parser.parse_args()
    device = device_name()
    peak = a.peak_tflops or (peak_tflops(device) if a.precision == "bf16" else None)
    if peak is None:
        parser.error(f"no known peak for {device!r} in {a.precision}: give --peak_tflops")
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
        measures = {
            run: measure_reference(a) if run == "reference loop" else measure_train_py(run, Path(work), a)
            for run in a.runs
        }
        medians = alternate(measures, a.repeats)
    reference, planned = medians.get("reference loop"), planned_gb(a)
    rows = []
    for run, m in medians.items():
        mfu = m["tokens_per_s"] * flops_per_token(a) / (peak * 1e12)
        vs_reference = m["tokens_per_s"] / reference["tokens_per_s"] if reference else ""
        rows.append(
            [
                run,
                m["tokens_per_s"],
                f"{100 * mfu:.1f}%",
                vs_reference,
                m["peak_gb"] or "",
                planned[run],
                "met" if mfu >= GOAL else "NOT met",
            ]
        )
    text = table(
        ["run", "tokens/s per GPU", "MFU", "vs reference loop", "peak GB", "plan GB", f"goal MFU >= {GOAL:.0%}"], rows
    )
    text += (
        f"\n\nDevice: {device} ({machine()}); peak {peak:g} TFLOP/s {a.precision}. GPT {a.n_layer} layers x "
        f"{a.n_embd} ({a.n_head} heads; {parameters(a) / 1e9:.2f}B parameters), sequence {a.block_size}, "
        f"micro batch {a.micro_batch_size}, {a.steps} steps, one process; tokens/s from each run's median "
        f"step, medians of {a.repeats} alternating runs. 'peak GB': torch.cuda.max_memory_allocated; 'plan GB': "
        "`distsetup plan`'s estimate for the same strategy, without the CUDA runtime."
    )
    record("GPU throughput", text)


if __name__ == "__main__":
    main()

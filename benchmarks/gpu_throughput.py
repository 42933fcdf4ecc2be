"""Benchmark 4 (for a GPU): tokens/s per GPU and MFU of src/train.py with the built-in GPT at about 1B
parameters in bf16 on one GPU (plain, FSDP2 over one rank, DeepSpeed ZeRO-3 over one rank), against the
same model in reference_loop.py's minimal loops: the plain one ("reference loop"), and for ZeRO-3 the plain DeepSpeed
loop on the file train.py is given ("reference zero3": ZeRO-3's own pace on one GPU, which the plain loop's is not).
Goals: MFU >= 45%, train.py within 3% of its reference loop, and `distsetup plan`'s peak within 10% of the measured
one. Each run's peak GPU memory is shown beside `distsetup plan`'s estimate for it.

MFU = tokens/s x training FLOPs per token / the GPU's dense bf16 peak, with FLOPs per token = 6N + 12 L d T
(N parameters outside the embedding tables, L layers, width d, sequence T: the PaLM paper's appendix B, as
nanoGPT counts). tokens/s comes from each run's median step, so start-up and warm-up are left out.

Without a GPU it runs the same way on the CPU: give a small model and --peak_tflops (tests and the GPU check's dry
run do this). A run that fails is a row that says so: the others' figures are kept (`--json` writes them all).
"""

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_run_arguments, launch, machine, median, record, reference_argv, table, train_py_argv

from distsetup.training.model import throughput
from distsetup.training.model.throughput import peak_tflops

GOAL = 0.45  # MFU, eager, bf16, ~1B GPT (torchtitan reports 33-39% on H100s)
PACE_GOAL = 0.97  # train.py's tokens/s over its reference loop's
PLAN_GOAL = 0.10  # `distsetup plan`'s peak against the measured one
RUNS = ["train.py single", "train.py fsdp", "train.py zero3", "reference loop", "reference zero3"]
PLANNED_AS = {
    "train.py single": "ddp",
    "train.py fsdp": "fsdp_full_shard",
    "train.py zero3": "zero3",
    "reference loop": "ddp",
    "reference zero3": "zero3",
}  # `distsetup plan` strategy for each run (one GPU: DDP is plain)
# the run each run's pace is measured against: the plain loop, but for ZeRO-3 DeepSpeed's own loop on the same file
REFERENCE_OF = {"train.py zero3": "reference zero3"}
DISTSETUP = [sys.executable, "-m", "distsetup"]  # the CLI of this interpreter, installed as a script or not


def parameters(a) -> int:
    return sum(p.numel() for p in gpt_on_meta(a).parameters())


def flops_per_token(a) -> float:
    return throughput.flops_per_token(gpt_on_meta(a), a.block_size)


def gpt_on_meta(a):
    import torch

    from distsetup.training.model.gpt import GPT

    with torch.device("meta"):
        return GPT(256, a.block_size, a.n_layer, a.n_head, a.n_embd, 0.0)


def backend_overrides(backend: str, work: Path, a) -> list[str]:
    """The run config's overrides for `backend`."""
    if backend != "zero3":
        return [f"distributed.backend={backend}"]
    return ["distributed.backend=deepspeed", f"distributed.deepspeed_config={zero3_file(work, a)}"]


def zero3_file(work: Path, a) -> Path:
    """The ZeRO-3 runs' file, as `distsetup deepspeed` writes it, once for every run of this benchmark."""
    ds = work / "zero3.json"
    if ds.exists():
        return ds
    precision = ["--bf16"] if a.precision == "bf16" else []
    # --optimizer none: the runs hand DeepSpeed the torch AdamW the other runs use (DeepSpeed's own would be its
    # FusedAdam, compiled on first use with nvcc).
    optimizer = ["--optimizer", "none", "--micro_batch_size", str(a.micro_batch_size)]
    subprocess.run([*DISTSETUP, "deepspeed", "--zero_stage", "3", *precision, *optimizer, "-o", ds], check=True)
    return ds


def measure_train_py(run: str, work: Path, a):
    backend = run.split()[-1]
    runs = itertools.count()

    def measure() -> dict:  # the backend's file made here: a failure there is this run's, the others go on
        out = work / f"{backend}-{next(runs)}"
        launch(1, train_py_argv(a, out, backend_overrides(backend, work, a)))
        summary = json.loads((out / "summary.json").read_text())
        shutil.rmtree(out)  # the final checkpoint of a 1B model: about 12 GB per run
        return figures(summary, a)

    return measure


def measure_reference(run: str, work: Path, a):
    def measure() -> dict:
        if run == "reference zero3":
            argv = [*reference_argv("zero3", a), f"--deepspeed_config={zero3_file(work, a)}"]
        else:
            argv = reference_argv("single", a)
        return figures(json.loads(launch(1, argv).strip().splitlines()[-1]), a)

    return measure


def planned_gb(a) -> dict:
    """`distsetup plan`'s peak per run, less the CUDA runtime it adds (which max_memory_allocated never sees)."""
    plan = subprocess.run(
        [
            *DISTSETUP,
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
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()


def measured(measures: dict, repeats: int, progress=lambda samples, failures: None) -> tuple[dict, dict]:
    """(run -> median figures over alternating rounds, run -> why it failed): a failed run is left out of later
    rounds, and the others go on. `progress(samples, failures)` after each run: what is known so far is kept even
    if the whole is stopped (the GPU check's time limit)."""
    samples: dict[str, list] = {run: [] for run in measures}
    failures: dict[str, str] = {}
    for _ in range(repeats):
        for run, measure in measures.items():
            if run in failures:
                continue
            try:
                samples[run].append(measure())
            except (RuntimeError, subprocess.CalledProcessError, OSError, ValueError) as e:
                output = str(e) + (e.stderr or "" if isinstance(e, subprocess.CalledProcessError) else "")
                print(f"{run} failed:\n{output}", file=sys.stderr)  # whole, for the GPU check's log
                failures[run] = why_failed(output)
            progress(samples, failures)
    return {run: median(values) for run, values in samples.items() if values and run not in failures}, failures


def why_failed(output: str) -> str:
    """The line of a failed run's output that says why: the trainer's own `error:` line, else the last exception's."""
    lines = [line.removeprefix("[rank0]:").strip() for line in output.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error:")]
    raised = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
    return (said or raised or lines or ["no output"])[-1][:300]


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
    parser.add_argument("--json", type=Path, help="also write every figure (and each failed run's reason) here")
    parser.add_argument("--work_dir", type=Path, help="where the runs write (their checkpoints); default: a temp dir")
    a = parser.parse_args()
    device = device_name()
    peak = a.peak_tflops or (peak_tflops(device) if a.precision == "bf16" else None)
    if peak is None:
        parser.error(f"no known peak for {device!r} in {a.precision}: give --peak_tflops")
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=a.work_dir) as work:
        measures = {
            run: measure_reference(run, Path(work), a)
            if run.startswith("reference")
            else measure_train_py(run, Path(work), a)
            for run in a.runs
        }

        def progress(samples: dict, failures: dict) -> None:
            if a.json:
                partial = {"device": device, "peak_tflops": peak, "measured_so_far": samples, "failed": failures}
                a.json.write_text(json.dumps(partial, indent=2))

        medians, failures = measured(measures, a.repeats, progress)
    planned = planned_gb(a)
    rows, figures = [], {}
    for run, m in medians.items():
        mfu = m["tokens_per_s"] * flops_per_token(a) / (peak * 1e12)
        reference = medians.get(REFERENCE_OF.get(run, "reference loop"))
        vs_reference = m["tokens_per_s"] / reference["tokens_per_s"] if reference else None
        plan_error = planned[run] / m["peak_gb"] - 1 if m["peak_gb"] else None
        figures[run] = {**m, "mfu": mfu, "vs_reference": vs_reference, "plan_gb": planned[run]}
        rows.append(
            [
                run,
                m["tokens_per_s"],
                f"{100 * mfu:.1f}%",
                "" if vs_reference is None else vs_reference,
                m["peak_gb"] or "",
                planned[run],
                "" if plan_error is None else f"{100 * plan_error:+.0f}%",
                ", ".join(goals_met(mfu, vs_reference if run.startswith("train.py") else None, plan_error)),
            ]
        )
    rows += [[run, "failed", "", "", "", "", "", why] for run, why in failures.items()]
    headers = ["run", "tokens/s per GPU", "MFU", "vs reference", "peak GB", "plan GB", "plan vs peak", "goals"]
    text = table(headers, rows)
    text += (
        f"\n\nDevice: {device} ({machine()}); peak {peak:g} TFLOP/s {a.precision}. GPT {a.n_layer} layers x "
        f"{a.n_embd} ({a.n_head} heads; {parameters(a) / 1e9:.2f}B parameters), sequence {a.block_size}, "
        f"micro batch {a.micro_batch_size}, {a.steps} steps, one process; tokens/s from each run's median "
        f"step, medians of {a.repeats} alternating runs. 'peak GB': torch.cuda.max_memory_allocated; 'plan GB': "
        "`distsetup plan`'s estimate for the same strategy, without the CUDA runtime. Goals: MFU >= "
        f"{GOAL:.0%}, train.py within {1 - PACE_GOAL:.0%} of its reference (train.py zero3's: reference zero3, the "
        "plain DeepSpeed loop on its file; the others' and reference zero3's own: the reference loop), plan within "
        f"{PLAN_GOAL:.0%} of the measured peak."
    )
    record("GPU throughput", text)
    if a.json:
        a.json.write_text(
            json.dumps(
                {"device": device, "peak_tflops": peak, "runs": figures, "failed": failures, "table": text}, indent=2
            )
        )
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed: {', '.join(failures)}")


def goals_met(mfu: float, vs_reference: float | None, plan_error: float | None) -> list[str]:
    """What the row meets of the goals, each named: "MFU met", "pace NOT met", ..."""
    verdicts = [("MFU", mfu >= GOAL)]
    if vs_reference is not None:
        verdicts.append(("pace", vs_reference >= PACE_GOAL))
    if plan_error is not None:
        verdicts.append(("plan", abs(plan_error) <= PLAN_GOAL))
    return [f"{name} {'met' if ok else 'NOT met'}" for name, ok in verdicts]


if __name__ == "__main__":
    main()

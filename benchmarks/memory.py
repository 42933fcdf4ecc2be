"""Benchmark 3: per-rank bytes of parameters, gradients and optimizer state held by src/train.py with 2
ranks (DDP, ZeRO-1/2/3, FSDP full shard), beside the ZeRO paper's model and `distsetup plan`'s prediction.

The ZeRO model, worked out for fp32 Adam (4 bytes of parameters, 4 of gradients, 8 of Adam moments per
parameter; N = 2): DDP 16P; ZeRO-1 4P + 4P + 8P/N; ZeRO-2 4P + (4P + 8P)/N; ZeRO-3 and FSDP full
shard 16P/N. DeepSpeed also keeps an fp32 master copy of its partition (4P/N), which the paper folds
into K only for mixed precision; `plan` counts it."""

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from common import BIN, REPO, record, table

N = 2
RUNS = {  # name -> (backend, distsetup deepspeed flags, planner strategy)
    "DDP": ("ddp", None, "ddp"),
    "ZeRO-1": ("deepspeed", ["--zero_stage", "1"], "zero1"),
    "ZeRO-2": ("deepspeed", ["--zero_stage", "2"], "zero2"),
    "ZeRO-3": ("deepspeed", ["--zero_stage", "3", "--stage3_param_persistence_threshold", "0"], "zero3"),
    "FSDP full shard": ("fsdp", None, "fsdp_full_shard"),
}


def zero_model(name: str, P: int) -> float:
    """Model-state bytes per rank from the ZeRO paper, for fp32 Adam."""
    return {"DDP": 16 * P, "ZeRO-1": 8 * P + 8 * P / N, "ZeRO-2": 4 * P + 12 * P / N}.get(name, 16 * P / N)


def train(name: str, backend: str, ds_flags, overrides: list[str], work: Path) -> dict:
    out = work / name.replace(" ", "_")
    extra = []
    if ds_flags:
        ds = work / f"{out.name}.json"
        subprocess.run(
            [
                str(BIN / "distsetup"),
                "deepspeed",
                *ds_flags,
                "--micro_batch_size",
                "4",
                "--world_size",
                str(N),
                "-o",
                ds,
            ],
            check=True,
            capture_output=True,
        )
        extra = ["--deepspeed", ds]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            f"--nproc_per_node={N}",
            "src/train.py",
            "--config",
            REPO / "config" / "config.yaml",
            "--no_resume",
            *overrides,
            f"distributed.backend={backend}",
            f"training.output_dir={out}",
            *extra,
        ],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    return json.loads((out / "summary.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    a = parser.parse_args()
    from distsetup.cli.commands.plan import count_on_meta
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.planning.estimates import BY_KEY, Hardware, model_states

    overrides = [
        f"model.n_layer={a.n_layer}",
        f"model.n_embd={a.n_embd}",
        "training.max_steps=3",
        "training.micro_batch_size=4",
    ]
    shape = count_on_meta(load_run_config(REPO / "config" / "config.yaml", overrides))
    work = Path(tempfile.mkdtemp(prefix="bench-mem-"))
    rows = []
    for name, (backend, ds_flags, key) in RUNS.items():
        memory = train(name, backend, ds_flags, overrides, work)["memory"]
        measured = memory["params"] + memory["grads"] + memory["optimizer"] + memory.get("master_params", 0)
        predicted = model_states(BY_KEY[key], shape, Hardware(1, N, runtime_bytes=0), "fp32")
        planned = predicted["params"] + predicted["grads"] + predicted["fp32_grads"] + predicted["optimizer"]
        paper = zero_model(name, shape.params)
        rows.append(
            [
                name,
                memory["params"] / 1e6,
                memory["grads"] / 1e6,
                (memory["optimizer"] + memory.get("master_params", 0)) / 1e6,
                measured / 1e6,
                paper / 1e6,
                measured / paper,
                planned / 1e6,
                measured / planned,
            ]
        )
    text = table(
        [
            "strategy",
            "params MB",
            "grads MB",
            "optim MB",
            "measured MB",
            "ZeRO model MB",
            "measured/model",
            "plan MB",
            "measured/plan",
        ],
        rows,
    )
    text += (
        f"\n\nGPT {a.n_layer} layers x {a.n_embd} ({shape.params / 1e6:.2f}M parameters), fp32, {N} CPU ranks; "
        "bytes per rank held after the last step (rank 0), MB = 1e6 bytes. 'optim' includes DeepSpeed's "
        "fp32 master copy; 'plan' adds the fp32 gradient partition DeepSpeed keeps."
    )
    record("Memory per rank", text)


if __name__ == "__main__":
    main()

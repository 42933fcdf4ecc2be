"""Every backend trains on one device rank: NCCL, CUDA autocast and DeepSpeed's CUDA engine on a GPU (the dry run:
the same runs on the CPU with gloo). Each run's pace, peak device memory and MFU go into the GPU check's report."""

import json
import math

import pytest
from conftest import DEVICE
from train_runs import cli_file, losses, train, write_config

STEPS, MICRO = 6, 8
MODEL_TRAINING = {
    "max_steps": STEPS,
    "checkpoint_interval": STEPS,
    "log_interval": 1,
    "warmup_steps": 0,
    "micro_batch_size": MICRO,
}


def backend_files(backend: str, precision: str) -> tuple[str, dict | None]:
    """(distributed.backend, its file as `distsetup fsdp|deepspeed` writes it) for one case."""
    if backend in ("single", "ddp"):
        return backend, None
    if backend.startswith("fsdp"):
        offload = ["--cpu_offload"] if backend == "fsdp_offload" else []
        mixed = {"bf16": "BFLOAT16", "fp32": "no"}[precision]
        return "fsdp", cli_file("fsdp", "--sharding_strategy", "FULL_SHARD", "--mixed_precision", mixed, *offload)
    stage = backend[4]  # zero1, zero2, zero3, zero2_offload
    offload = ["--offload_optimizer"] if backend.endswith("offload") else ["--optimizer", "none"]  # torch's AdamW
    flags = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[precision]
    ds = cli_file(
        "deepspeed", "--zero_stage", stage, *flags, *offload, "--world_size", "1", "--micro_batch_size", str(MICRO)
    )
    return "deepspeed", ds


# (backend, precision): fp16 where the backend trains in it (FSDP2 runs bf16 or fp32 in distsetup's trainer)
CASES = [
    ("single", "bf16"),
    ("single", "fp16"),
    ("ddp", "bf16"),
    ("ddp", "fp16"),
    ("fsdp", "bf16"),
    ("fsdp_offload", "bf16"),  # CPU offload with gradient clipping: CPU collectives beside NCCL
    ("zero1", "bf16"),
    ("zero1", "fp16"),
    ("zero2", "bf16"),
    ("zero2", "fp16"),
    ("zero3", "bf16"),
    ("zero3", "fp16"),
    ("zero2_offload", "bf16"),  # DeepSpeed's CPU Adam, compiled on first use
]


@pytest.mark.parametrize(("backend", "precision"), CASES, ids=[f"{b}-{p}" for b, p in CASES])
def test_backend_trains_on_one_device_rank(tmp_path, backend, precision, record):
    name, backend_file = backend_files(backend, precision)
    training = {**MODEL_TRAINING, "precision": precision}
    config = write_config(tmp_path, backend, name, backend_file, training)
    result = train(config, 1, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("backend ")]
    assert f" on 1 x {DEVICE}; " in line, line
    curve = losses(tmp_path / "out")
    assert len(curve) == STEPS and all(math.isfinite(loss) for loss in curve), curve
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    if DEVICE == "cuda":  # what the CPU has not: device memory and a known peak for MFU
        assert summary["peak_device_bytes"] > 0 and summary["mfu"] is not None, summary
    record(
        backend_line=line,
        median_step_seconds=summary["median_step_seconds"],
        tokens_per_s=summary["tokens_per_s"],
        mfu=summary["mfu"],
        peak_device_bytes=summary["peak_device_bytes"],
        losses=curve,
    )

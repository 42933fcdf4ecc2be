"""An fp16 run resumed under another ZeRO stage or backend goes on at the scale its checkpoint was at, and grows it
when the interrupted run would have (checkpoint/loss_scale.py): the loss scale is training state, and a scale that
starts over costs a run a burst of skipped steps (DeepSpeed from 2^16 or more, overflowing down) or its precision
(torch's GradScaler starts at 2^16, far below where a DeepSpeed run may be).

The DeepSpeed runs are real fp16 engines on the CPU. Some CPUs lack oneDNN's fp16 kernels, and DeepSpeed's CPU
accelerator refuses fp16 there although torch computes it; tests/support/fp16_on_any_cpu lifts that one check so
that these tests run, and assert the same, on every machine."""

import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from repo import SUPPORT
from train_runs import SHARED, TRAINING, ds_file, losses, train, write_config

from distsetup.formats.checkpoint_folder import step_dir

ANY_CPU = {
    "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT / "fp16_on_any_cpu"), os.environ.get("PYTHONPATH")]))
}
STEPS, INTERVAL, MICRO = 20, 10, 12
# a DeepSpeed scale that starts high and moves within a few steps: it falls by overflows to where the model's
# gradients fit, then grows and overflows again; a fresh GradScaler would start at 2^16, this file at 2^24
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 4, "initial_scale_power": 24, "hysteresis": 2}
FRESH_TORCH_SCALE = 2.0**16
SETTINGS = {**TRAINING, "precision": "fp16", "micro_batch_size": MICRO, "gradient_accumulation_steps": 1}


def fp16_deepspeed_file(stage: int) -> dict:
    return {**ds_file(stage), "fp16": {**FP16, "min_loss_scale": 1}}


@functools.cache
def source_run(backend: str) -> Path:
    """A 2-rank fp16 run with a checkpoint at step INTERVAL, its output_dir: ZeRO-2 to step STEPS, the reference
    for resumed runs, or DDP to step INTERVAL, a source only."""
    folder = SHARED / f"fp16_{backend}"
    backend_file = fp16_deepspeed_file(2) if backend == "deepspeed" else None
    steps = STEPS if backend == "deepspeed" else INTERVAL
    config = write_config(folder, backend, backend, backend_file, {**SETTINGS, "max_steps": steps})
    result = train(config, 2, env=ANY_CPU)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder / "out"


def resume(tmp_path, source: str, backend: str, backend_file: dict | None, max_steps: int):
    """Resume source_run(source)'s step-INTERVAL checkpoint under `backend` on 2 ranks; (result, output_dir)."""
    out = tmp_path / "out"
    shutil.copytree(step_dir(source_run(source) / "checkpoints", INTERVAL), step_dir(out / "checkpoints", INTERVAL))
    config = write_config(tmp_path, "resumed", backend, backend_file, {**SETTINGS, "max_steps": max_steps})
    result = train(config, 2, env=ANY_CPU)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fp16 loss scale" in next(line for line in result.stdout.splitlines() if "converted" in line)
    return result, out


def saved_scaler(run: Path) -> dict:
    """The GradScaler state in the step-INTERVAL state.pt of single/DDP run folder `run`."""
    return torch.load(step_dir(run / "checkpoints", INTERVAL) / "state.pt", weights_only=False)["scaler"]


def loss_scales(output_dir: Path) -> dict[int, float]:
    """Step -> the loss scale its backward used."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss_scale"] for row in rows if "loss_scale" in row}


def test_zero2_resumed_under_zero1_goes_on_with_the_same_scale_at_every_step(tmp_path):
    """DeepSpeed's own path (ds_to_universal, then the universal load, which takes the folder's loss scaler) with
    distsetup's restore on top: every step's scale as in the uninterrupted run."""
    _, out = resume(tmp_path, "deepspeed", "deepspeed", fp16_deepspeed_file(1), STEPS)
    uninterrupted = loss_scales(source_run("deepspeed"))
    assert len(set(uninterrupted.values())) > 2  # the scale moves in both halves: the test can tell scales apart
    assert loss_scales(out) == {step: uninterrupted[step] for step in range(INTERVAL + 1, STEPS + 1)}
    assert uninterrupted[INTERVAL + 1] != 2.0 ** FP16["initial_scale_power"]
    assert losses(out) == pytest.approx(losses(source_run("deepspeed"))[INTERVAL:], rel=1e-3)


def test_zero2_resumed_under_ddp_takes_the_scale_and_its_growth_steps(tmp_path):
    """Until the next overflow: after one, torch grows a step before DeepSpeed (loss_scale.py)."""
    _, out = resume(tmp_path, "deepspeed", "ddp", None, INTERVAL + 3)
    uninterrupted = loss_scales(source_run("deepspeed"))
    resumed = loss_scales(out)
    assert resumed == {step: uninterrupted[step] for step in range(INTERVAL + 1, INTERVAL + 4)}
    assert resumed[INTERVAL + 1] != FRESH_TORCH_SCALE
    assert max(resumed.values()) > resumed[INTERVAL + 1]  # it grew: the growth position came along too


@pytest.mark.parametrize("stage", [1, 3])
def test_ddp_resumed_under_deepspeed_goes_on_at_the_gradscaler_scale_with_the_files_settings(tmp_path, stage):
    """DeepSpeed 0.19's universal load takes the folder's loss scaler whole, settings included: distsetup gives the
    run its own file's (a window of 4 steps, where GradScaler's is 2000) at the checkpoint's scale."""
    _, out = resume(tmp_path, "ddp", "deepspeed", fp16_deepspeed_file(stage), INTERVAL + 6)
    scale = saved_scaler(source_run("ddp"))["scale"]
    # grown after the file's window (+1, DeepSpeed's count): far below the scale where ZeRO-2 overflowed
    assert loss_scales(out) == {**dict.fromkeys(range(INTERVAL + 1, INTERVAL + 6), scale), INTERVAL + 6: 2 * scale}


def test_converting_ddp_to_deepspeed_and_back_keeps_the_gradscaler_state(run_cli, tmp_path):
    source = source_run("ddp")
    assert run_cli("checkpoint", "convert", source, "--to", "deepspeed", "-o", tmp_path / "ds").exit_code == 0
    assert run_cli("checkpoint", "convert", tmp_path / "ds", "--to", "ddp", "-o", tmp_path / "ddp").exit_code == 0
    assert saved_scaler(tmp_path / "ddp") == saved_scaler(source)
    assert saved_scaler(source)["_growth_tracker"] > 0  # the good steps counted toward growth are kept too

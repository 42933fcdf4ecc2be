"""DeepSpeed ZeRO-0 in bf16 keeps its optimizer in DeepSpeed's wrapper (checkpoint/zero0_wrapper.py): fp32 master
weights beside the module's bf16 ones, in one of two forms. Its checkpoint converted to another backend's layout and
resumed under the same ZeRO-0 file continues the uninterrupted run's loss curve: the masters, moments and steps went
out and came back by parameter name."""

import functools
import shutil
from pathlib import Path

import pytest
import torch
from train_runs import SHARED, TRAINING, ds_file, losses, train, write_config

from distsetup.formats.checkpoint_folder import step_dir

STEPS, INTERVAL = 20, 10
ADAMW_BLOCK = {"type": "AdamW", "params": {"lr": TRAINING["lr"], "betas": [0.9, 0.95], "weight_decay": 0.01}}
# form -> DeepSpeed file: torch's AdamW (passed by the trainer) gets FP16_UnfusedOptimizer, a master per parameter;
# the file's AdamW block gets DeepSpeed's FusedAdam and FP16_Optimizer, a flat master per param group
FILES = {
    "unfused": {**ds_file(0), "bf16": {"enabled": True}},
    "fused": {**ds_file(0), "bf16": {"enabled": True}, "optimizer": ADAMW_BLOCK},
}
# form -> the layout it is converted to and back from (`checkpoint convert --to`)
THROUGH = {"unfused": "ddp", "fused": "deepspeed"}
SETTINGS = {**TRAINING, "precision": "bf16", "micro_batch_size": 24, "gradient_accumulation_steps": 1}


def one_rank_file(form: str) -> dict:
    return {**FILES[form], "train_micro_batch_size_per_gpu": 24, "train_batch_size": 24}


def zero0_config(folder: Path, form: str) -> Path:
    """A 1-rank ZeRO-0 bf16 run of STEPS steps, its output in folder/out."""
    return write_config(folder, form, "deepspeed", one_rank_file(form), {**SETTINGS, "max_steps": STEPS})


@functools.cache
def uninterrupted_run(form: str) -> Path:
    """The run folder of a ZeRO-0 bf16 run of `form` that nothing interrupts, with a checkpoint at INTERVAL."""
    folder = SHARED / f"zero0_bf16_{form}"
    result = train(zero0_config(folder, form))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder


@pytest.mark.parametrize("form", FILES)
def test_a_zero0_bf16_checkpoint_converted_and_back_continues_the_same_curve(run_cli, tmp_path, form):
    uninterrupted = uninterrupted_run(form)
    saved = torch.load(
        step_dir(uninterrupted / "out" / "checkpoints", INTERVAL) / "mp_rank_00_model_states.pt", weights_only=False
    )
    assert ("fp32_groups_flat" if form == "fused" else "fp32_groups") in saved["optimizer"]  # the form meant

    source = tmp_path / "source"
    shutil.copytree(
        step_dir(uninterrupted / "out" / "checkpoints", INTERVAL), step_dir(source / "checkpoints", INTERVAL)
    )
    converted = tmp_path / "out"  # the resumed run's output folder
    assert run_cli("checkpoint", "convert", source, "--to", THROUGH[form], "-o", converted).exit_code == 0
    result = train(zero0_config(tmp_path, form))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "converted for this run (deepspeed ZeRO-0, 1 rank)" in result.stdout
    resumed, expected = losses(converted), losses(uninterrupted / "out")[INTERVAL:]
    assert len(resumed) == STEPS - INTERVAL
    if form == "unfused":
        assert resumed == expected
    else:  # 6e-6 relative off at most, as DeepSpeed's own resume of that checkpoint is (masters taken in bf16: 1e-4)
        assert resumed == pytest.approx(expected, rel=2e-5)


def test_a_zero0_bf16_checkpoint_resumed_with_the_other_optimizer_form_loads_by_name(tmp_path):
    """The DeepSpeed file's optimizer block added since the checkpoint: DeepSpeed's own load would fail."""
    shutil.copytree(
        step_dir(uninterrupted_run("unfused") / "out" / "checkpoints", INTERVAL),
        step_dir(tmp_path / "out" / "checkpoints", INTERVAL),
    )
    result = train(zero0_config(tmp_path, "fused"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fp32 masters per parameter (a torch optimizer), this run flat fp32 masters" in result.stdout
    resumed, expected = losses(tmp_path / "out"), losses(uninterrupted_run("unfused") / "out")[INTERVAL:]
    assert resumed == pytest.approx(expected, rel=2e-5)  # FusedAdam where torch's AdamW ran: the same update

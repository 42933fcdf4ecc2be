"""A run resumed on another number of processes, with its global batch split otherwise, under another ZeRO stage
or another backend (single, DDP, FSDP, DeepSpeed ZeRO 0-3, with or without optimizer offload) continues the
uninterrupted run's loss curve; checkpoint retention (training.keep_checkpoints) removes only what it may.

Each case copies one checkpoint (step 10) of a shared 30-step run into a fresh output folder, which is what a
job killed after step 10 leaves behind (test_train_resume kills real ranks), and resumes it elsewhere."""

import re
import shutil
import time

import pytest
import torch
from train_runs import (
    GLOBAL_BATCH,
    INTERVAL,
    RUNS,
    STEPS,
    TRAINING,
    ds_split,
    final_weights,
    losses,
    shared_run,
    train,
    write_config,
)

from distsetup.formats.checkpoint_folder import MARKER, step_dir

ZERO0 = {**ds_split("zero1", 1, GLOBAL_BATCH), "zero_optimization": {"stage": 0}}


# case -> (source run, backend, processes, backend file for them, micro-batch, accumulation)
RESHAPES = {
    "zero3 2 -> 1": ("zero3", "deepspeed", 1, lambda: ds_split("zero3", 1, GLOBAL_BATCH), GLOBAL_BATCH, 1),
    "zero3 2 -> 3": ("zero3", "deepspeed", 3, lambda: ds_split("zero3", 3, 8), 8, 1),
    "fsdp 2 -> 1": ("fsdp_full", "fsdp", 1, lambda: RUNS["fsdp_full"][2], GLOBAL_BATCH, 1),
    "zero1 2 -> 3, micro 4": ("zero1", "deepspeed", 3, lambda: ds_split("zero1", 3, 4), 4, 2),
    "zero3 2 -> zero2 1": ("zero3", "deepspeed", 1, lambda: ds_split("zero2", 1, GLOBAL_BATCH), GLOBAL_BATCH, 1),
    "ddp 2 -> fsdp 2": ("ddp", "fsdp", 2, lambda: RUNS["fsdp_full"][2], 12, 1),
    "zero2 cpu offload -> ddp": ("zero2_offload", "ddp", 2, lambda: None, 12, 1),
    # the file's own optimizer, with DeepSpeed's betas and another lr: the checkpoint's (and its schedule) go on
    "fsdp -> zero3, activation checkpointing, the file's optimizer": (
        "fsdp_full",
        "deepspeed",
        2,
        lambda: {
            **ds_split("zero3", 2, 12),
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.999]}},
        },
        12,
        1,
    ),
    "single -> zero2 cpu offload, 2 ranks": ("single", "deepspeed", 2, lambda: ds_split("zero2_offload", 2, 12), 12, 1),
    "zero1 2 -> zero0 1": ("zero1", "deepspeed", 1, lambda: ZERO0, GLOBAL_BATCH, 1),
}


def resume_elsewhere(
    tmp_path, source: str, backend: str, processes: int, backend_file, micro: int, accumulation: int, **settings
):
    out = tmp_path / "out"
    checkpoint = step_dir(out / "checkpoints", INTERVAL)
    shutil.copytree(step_dir(shared_run(source) / "checkpoints", INTERVAL), checkpoint)
    training = {**TRAINING, "micro_batch_size": micro, "gradient_accumulation_steps": accumulation, **settings}
    config = write_config(tmp_path, source, backend, backend_file, training)
    return train(config, processes), out


@pytest.mark.parametrize("case", RESHAPES)
def test_a_run_resumed_elsewhere_continues_the_same_loss_curve(tmp_path, case):
    source, backend, processes, backend_file, micro, accumulation = RESHAPES[case]
    # activation checkpointing wraps the blocks: DeepSpeed names their parameters with the wrapper's prefix
    recompute = {"activation_checkpointing": "activation checkpointing" in case}
    result, out = resume_elsewhere(
        tmp_path, source, backend, processes, backend_file(), micro, accumulation, **recompute
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(rf"resumed from \S+step_{INTERVAL:07d} \(step {INTERVAL}\)", result.stdout)
    before, after = rf"\({RUNS[source][1]}[^)]*, {RUNS[source][0]} ranks?\)", rf"\({backend}[^)]*, {processes} rank"
    line = rf"{before} converted.* for this run {after}"
    converts = (RUNS[source][1], backend) != ("fsdp", "fsdp")  # DCP reshards FSDP's own folders as it loads
    assert len(re.findall(line, result.stdout)) == converts, result.stdout  # in one line
    goes_on = "the checkpoint's learning-rate schedule goes on, to peak lr 0.003; this run's 0.0005" in result.stdout
    assert goes_on == ("file's optimizer" in case), result.stdout
    assert not list(out.glob(".universal-*"))  # the converted copy is gone once loaded
    resumed, uninterrupted = losses(out), losses(shared_run(source))[INTERVAL:]
    assert len(resumed) == STEPS - INTERVAL >= 20
    assert resumed == pytest.approx(uninterrupted, rel=1e-4)
    # and each tensor: a setting the resume lost (weight decay, say) moves few parameters and little loss. Not
    # the qkv biases: their key part gets no gradient (softmax ignores a constant added to every key), so Adam
    # turns rounding noise, which differs with the world size, into steps of the learning rate's size there.
    weights, reference = final_weights(out), final_weights(shared_run(source))
    drift = {k: float((weights[k] - v).norm() / v.norm()) for k, v in reference.items() if "qkv.bias" not in k}
    assert max(drift.values()) < 1e-4, sorted(drift.items(), key=lambda kv: -kv[1])[:3]
    assert step_dir(out / "checkpoints", INTERVAL).joinpath(MARKER).is_file()  # the source is left as it was
    if backend == "deepspeed":  # the engine counts on from the checkpoint's step (its logs, its files)
        model_states = next(step_dir(out / "checkpoints", STEPS).glob("*model_states.pt"))
        assert torch.load(model_states, weights_only=False)["global_steps"] == STEPS


# case -> (source run, file damaged in its step-10 folder, backend resuming it, backend file)
DAMAGED = {
    "zero2 -> ddp: every rank reads the partitions": (
        "zero2",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "ddp",
        None,
    ),
    "ddp -> zero2: rank 0 converts": ("ddp", "state.pt", "deepspeed", ds_split("zero2", 2, 12)),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_checkpoint_of_another_backend_ends_every_rank_in_one_line(tmp_path, case):
    """Damage that keeps the file's size shows only when it is read: every rank stops at once with one line, long
    before the collective timeout, and no converted copy is left behind."""
    source, damaged, backend, backend_file = DAMAGED[case]
    out = tmp_path / "out"
    checkpoint = step_dir(out / "checkpoints", INTERVAL)
    shutil.copytree(step_dir(shared_run(source) / "checkpoints", INTERVAL), checkpoint)
    (checkpoint / damaged).write_bytes(b"\xff" * (checkpoint / damaged).stat().st_size)
    training = {**TRAINING, "micro_batch_size": 12, "gradient_accumulation_steps": 1}
    config = write_config(tmp_path, source, backend, backend_file, training)
    began = time.monotonic()
    result = train(config, 2)
    took = time.monotonic() - began
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors, result.stdout[-2000:] + result.stderr[-3000:]
    assert all(f"checkpoint {checkpoint}" in line and damaged in line and "--no_resume" in line for line in errors)
    ours = 'train.py", line' in result.stderr or "distsetup/training/" in result.stderr  # torchrun's may follow
    assert not ours and "No such file" not in result.stderr, result.stderr[-3000:]
    assert took < 90, f"{took:.0f} s: a rank waited for the others (timeout 2 minutes)"
    assert not list(out.glob(".universal-*")) and not (out / "metrics.jsonl").exists()


def test_a_run_with_keep_checkpoints_ends_with_the_newest_ones(tmp_path):
    training = {**TRAINING, "micro_batch_size": GLOBAL_BATCH, "checkpoint_interval": 4, "max_steps": 12}
    config = write_config(tmp_path, "single", "single", None, {**training, "keep_checkpoints": 2})
    leftover = step_dir(tmp_path / "out" / "checkpoints", 1)  # a crash's half-written folder: not ours to judge
    leftover.mkdir(parents=True)
    result = train(config, 1)
    assert result.returncode == 0, result.stderr[-3000:]
    remaining = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert remaining == [leftover.name, step_dir(tmp_path, 8).name, step_dir(tmp_path, 12).name]

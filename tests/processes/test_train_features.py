"""Features beyond the basic parity runs, each on real 2-process CPU runs (tests/support/train_runs.py FEATURE_RUNS).

Parity runs split the global batch 16 as micro 4 x accumulation 2 x 2 processes against one process with
micro 4 x accumulation 4, so DDP's no_sync, FSDP's set_requires_gradient_sync(False) and DeepSpeed's
accumulation boundary all take part; the same runs carry activation checkpointing, FSDP size-based
wrapping, hybrid sharding on both 2-D mesh shapes, a full-state-dict checkpoint and ZeRO-3 offload.
"""

import json
import math
import os
import re
import signal

import pytest
import torch
from train_runs import (
    FEATURE_BATCH,
    FEATURE_STEPS,
    MICRO,
    MODEL,
    deepspeed_supports,
    feature_attempt,
    feature_run,
    final_weights,
    losses,
    start,
    train,
    wait_for,
    worker_pids,
    write_feature_config,
)

RTOL = 1e-4  # as tests/processes/test_train_parity.py: fp32, same data, same arithmetic up to summation order
# run -> what its log must say it did (so a silently ignored setting cannot pass as parity)
PARITY = {
    "acc_ddp_ckpt": [],
    "acc_fsdp_ckpt_full_sd": [],
    "acc_zero2": [r"\(ZeRO-2\)"],
    "acc_zero2_one_process": [r"\(ZeRO-2\) on 1 x cpu; global batch 16 = micro 4 x accumulation 4 x world 1"],
    # DeepSpeedCPUAdam steps on the CPU copy: same AdamW formula, so the same tight tolerance holds
    "acc_zero3_offload": [r"\(ZeRO-3, optimizer offloaded to cpu, param offloaded to cpu\)"],
    "acc_fsdp_hybrid_size": [r"HYBRID_SHARD: 2-D device mesh, replicate 1 x shard 2"],
    "acc_fsdp_hybrid_zero2_nodes": [r"HYBRID_SHARD_ZERO2: 2-D device mesh, replicate 2 x shard 1"],
}


def log_of(name: str) -> str:
    feature_run(name)  # it must have passed
    return feature_attempt(name).stdout


def summary_of(name: str) -> dict:
    return json.loads((feature_run(name) / "summary.json").read_text())


@pytest.mark.parametrize("name", sorted(PARITY))
def test_accumulating_runs_match_the_single_process_curve(name):
    reference, curve = losses(feature_run("acc_single")), losses(feature_run(name))
    assert len(curve) == len(reference) == FEATURE_STEPS
    if name != "acc_zero2_one_process":
        assert f"global batch {FEATURE_BATCH} = micro {MICRO} x accumulation 2 x world 2" in log_of(name)
    assert f"micro {MICRO} x accumulation 4 x world 1" in log_of("acc_single")
    for pattern in PARITY[name]:
        assert re.search(pattern, log_of(name)), (pattern, log_of(name)[-2000:])
    worst = max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))
    assert worst <= RTOL, f"{name}: largest relative loss difference {worst:.2e} over {FEATURE_STEPS} steps"
    assert reference[-1] < reference[0] - 0.1, reference


def test_a_run_logged_to_a_file_prints_a_line_per_logged_step_and_no_bar():
    """Its output is a pipe, as a job's log is: rank 0 prints each logged step's figures once, the loss as
    metrics.jsonl has it, and no bar redraws itself with carriage returns."""
    result = feature_attempt("acc_ddp_ckpt")
    printed = re.findall(r"^step (\d+)/(\d+): loss (\S+), lr \S+, \S+ tokens/s$", result.stdout, re.M)
    logged = losses(feature_run("acc_ddp_ckpt"))
    assert [int(step) for step, _, _ in printed] == list(range(1, FEATURE_STEPS + 1))  # log_interval 1, rank 0 alone
    assert {int(total) for _, total, _ in printed} == {FEATURE_STEPS}
    assert [float(loss) for _, _, loss in printed] == pytest.approx(logged, abs=5e-5)
    assert "\r" not in result.stdout + result.stderr


@pytest.mark.parametrize("name", ["acc_ddp_ckpt", "acc_fsdp_ckpt_full_sd"])
def test_activation_checkpointing_was_on(name):
    """Same losses (above); and a block keeps only its input: far fewer bytes saved for backward."""
    plain, checkpointed = summary_of("acc_single"), summary_of(name)
    assert 0 < checkpointed["peak_activation_bytes"] < 0.5 * plain["peak_activation_bytes"]


def test_full_state_dict_checkpoint_survives_kill_9(tmp_path):
    config, nproc, _ = write_feature_config(tmp_path, "acc_fsdp_ckpt_full_sd", checkpoint_interval=4)
    out = tmp_path / "out"
    run = start(config, nproc)
    wait_for(out / "checkpoints" / "step_0000004" / "COMPLETE", run)
    os.kill(worker_pids(run.pid)[-1], signal.SIGKILL)
    run.wait(timeout=180)
    assert run.returncode != 0 and not (out / "summary.json").exists(), "the run finished before the kill"
    saved = out / "checkpoints" / "step_0000004"
    assert (saved / "full_state.pt").is_file() and not (saved / "model").exists()  # one file, not DCP shards

    resumed = train(config, nproc)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resumed from \S+step_\d+ \(step (\d+)\)", resumed.stdout)
    assert len(losses(out)) == FEATURE_STEPS
    uninterrupted = final_weights(feature_run("acc_fsdp_ckpt_full_sd"))
    weights = final_weights(out)
    assert weights.keys() == uninterrupted.keys() and len(weights) > 0
    for key in uninterrupted:
        assert torch.equal(weights[key], uninterrupted[key]), f"{key} differs after resume"


# bf16 under DeepSpeed: the LLM guide's run (test_guides.py)
LOW_PRECISION = {"bf16_ddp_files": "bf16", "bf16_fsdp": "bf16", "fp16_zero2": "fp16"}


@pytest.mark.parametrize("name", sorted(LOW_PRECISION))
def test_low_precision_runs_learn_where_the_device_supports_them(name):
    """Where DeepSpeed supports the precision on this device the run learns (fp16 with its loss scaler);
    where it does not, the trainer refuses before any process group, in one line naming the setting."""
    precision = LOW_PRECISION[name]
    if name.endswith("zero2") and not deepspeed_supports(precision):
        result = feature_attempt(name)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        ours = 'train.py", line' in result.stderr or "distsetup/training/" in result.stderr  # torchrun's may follow
        assert result.returncode != 0 and errors and not ours, result.stderr[-3000:]
        assert f"enables {precision}, which DeepSpeed does not support on this cpu device" in errors[0]
        assert f"set {precision}.enabled to false" in errors[0]
        assert "backend deepspeed" not in result.stdout  # refused before the process group and the model
        return
    curve, summary = losses(feature_run(name)), summary_of(name)
    assert len(curve) == FEATURE_STEPS and all(math.isfinite(x) for x in curve), curve
    assert curve[-1] < curve[0] - 0.3, curve
    assert summary["precision"] == LOW_PRECISION[name] and summary["world_size"] == 2
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] == curve[-1]


def test_text_files_train_with_linearly_scaled_lr():
    """bf16_ddp_files: a .txt and a .jsonl file, lr 5e-3 tuned for batch 8, run at global batch 16."""
    rows = [json.loads(line) for line in (feature_run("bf16_ddp_files") / "metrics.jsonl").read_text().splitlines()]
    expected = 5e-3 * FEATURE_BATCH / 8
    peak = max(rows, key=lambda r: r["lr"])
    assert peak["lr"] == pytest.approx(expected, rel=1e-9)
    warmup = 3  # TRAINING["warmup_steps"]: the logged lr is the one step `step` used, 1-based
    assert peak["step"] == warmup + 1
    assert f"lr scaled (linear) to {expected:.6g} for global batch {FEATURE_BATCH}" in log_of("bf16_ddp_files")


def test_throughput_leaves_checkpoint_writes_out():
    s = summary_of("acc_fsdp_ckpt_full_sd")  # writes a full-state-dict checkpoint at the end
    assert s["checkpoint_seconds"] > 0 and s["train_seconds"] > 0
    assert s["steps_per_s"] == pytest.approx(FEATURE_STEPS / s["train_seconds"], rel=1e-9)
    assert s["tokens_per_s"] == pytest.approx(s["steps_per_s"] * FEATURE_BATCH * MODEL["block_size"], rel=1e-9)


def test_notes_a_backend_adds_while_wrapping_are_printed():
    """The hybrid-sharded run's file also asks for parameter offload, which the CPU cannot honour: the run says so
    and trains on (its parity above)."""
    assert "note: fsdp_offload_params ignored: parameters already live on the CPU" in log_of("acc_fsdp_hybrid_size")

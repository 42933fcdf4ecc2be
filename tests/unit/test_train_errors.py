"""Bad input ends with one clear line and a non-zero status before any training starts."""

import json
import re
import signal
from pathlib import Path

import pytest
from train_runs import GLOBAL_BATCH, assert_clean_error, ds_file, train, write_run_config

from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import find_resume, step_dir


def test_missing_config(tmp_path):
    result = train(tmp_path / "nope.yaml")
    assert_clean_error(result, "nope.yaml")


def test_invalid_config(tmp_path):
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "training.learning_rate=-0.1")  # the HF Trainer's name, read as training.lr
    assert_clean_error(result, "training.lr: -0.1 is out of range")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_deepspeed_batch_identity_checked_for_the_real_world_size(tmp_path):
    bad = ds_file(2)  # train_batch_size 16 = 8 x 1 x 2, but a plain run has world size 1
    (tmp_path / "ds.json").write_text(json.dumps(bad))
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    line = assert_clean_error(
        result,
        f"train_batch_size: {GLOBAL_BATCH} != train_micro_batch_size_per_gpu {GLOBAL_BATCH // 2}",
        "world size 1",
    )
    assert f"= {GLOBAL_BATCH // 2}" in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_single_backend_refuses_several_processes(tmp_path, monkeypatch):
    config = write_run_config(tmp_path, "single")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    import train_runs

    monkeypatch.setattr(train_runs, "environment", lambda: {**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    result = train(config, 1)
    assert_clean_error(result, "distributed.backend: single trains one process", "world has 2 processes")


def test_empty_strings_are_not_files(tmp_path):
    config = write_run_config(tmp_path, "single")
    assert_clean_error(train(config, 1, "--deepspeed", ""), "--deepspeed is empty")
    assert_clean_error(train(config, 1, "--export", tmp_path), "--export", "is a folder")
    assert not (tmp_path / "out").exists()


def test_output_dir_that_cannot_be_a_folder(tmp_path):
    config = write_run_config(tmp_path, "single")
    (tmp_path / "taken").write_text("a file, not a folder")
    assert_clean_error(train(config, 1, f"training.output_dir={tmp_path / 'taken'}"), "training.output_dir", "taken")
    assert (tmp_path / "taken").read_text() == "a file, not a folder"
    assert_clean_error(train(config, 1, "training.output_dir=/proc/distsetup-run"), "training.output_dir", "/proc")


def test_empty_data_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "data.type=files", f"data.paths=[{json.dumps(str(tmp_path / 'empty.txt'))}]")
    assert_clean_error(result, "empty.txt", "empty")


def test_init_from_a_file_that_is_no_weights_file(tmp_path):
    (tmp_path / "random.pt").write_bytes(bytes(range(256)) * 40)
    config = write_run_config(tmp_path, "single")
    assert_clean_error(train(config, 1, "--init_from", tmp_path / "random.pt"), "--init_from", "random.pt")


def test_init_from_takes_the_folder_checkpoint_export_writes_and_names_what_is_not_there(tmp_path):
    from distsetup.train import init_from_weights

    exported = tmp_path / "exported"
    exported.mkdir()
    with pytest.raises(
        DistsetupError, match=r"^--init_from .*exported is a folder without model.safetensors\. HINT: name a file"
    ):
        init_from_weights(str(exported))  # was [Errno 21] Is a directory, after the data's set-up
    (exported / "model.safetensors").write_bytes(b"")
    assert init_from_weights(str(exported)) == str(exported / "model.safetensors")
    with pytest.raises(DistsetupError, match=r"^--init_from .*nothere.pt does not exist\. HINT"):
        init_from_weights(str(tmp_path / "nothere.pt"))


def test_model_too_large_to_build_is_one_line(tmp_path):
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "model.n_layer=2000", "model.n_embd=16384", "model.n_head=128")
    assert_clean_error(result, "parameters", "model.n_embd")


def test_mistyped_deepspeed_key_is_refused_not_ignored(tmp_path):
    typo = {**ds_file(2), "train_micro_batch_size_per_gpu": GLOBAL_BATCH}  # the identity holds for 1 process
    typo["zero_optimizaton"] = typo.pop("zero_optimization")  # DeepSpeed itself would run ZeRO-0 silently
    (tmp_path / "ds.json").write_text(json.dumps(typo))
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert_clean_error(result, "zero_optimizaton", "zero_optimization")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_zero0_in_fp16_which_deepspeed_does_not_loss_scale_is_refused(tmp_path):
    fp16 = {**ds_file(0), "train_micro_batch_size_per_gpu": GLOBAL_BATCH, "fp16": {"enabled": True}}
    (tmp_path / "ds.json").write_text(json.dumps(fp16))
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert_clean_error(result, "ZeRO stage 0", "does not loss-scale fp16", "zero_optimization.stage to 1")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_fsdp_file_with_impossible_values_is_refused(tmp_path):
    (tmp_path / "fsdp.json").write_text(
        json.dumps(
            {
                "fsdp_version": 2,
                "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                "fsdp_min_num_params": -7,
                "fsdp_offload_params": "yes",
            }
        )
    )
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "distributed.backend=fsdp", f"distributed.fsdp_config={tmp_path / 'fsdp.json'}")
    assert_clean_error(result, "fsdp.json", "fsdp_", "distsetup validate")


def test_an_error_mid_training_closes_its_progress_and_keeps_the_metrics(tmp_path):
    """An error during training closes rank 0's progress (in a terminal its bar: the error line starts a line of its
    own) and the metrics file. Here the checkpoint of step 2 cannot be written: a file is where it goes."""
    config = write_run_config(tmp_path, "single")
    checkpoints = tmp_path / "out" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_0000002").write_text("in the way")
    result = train(config, 1, "training.max_steps=4", "training.checkpoint_interval=2", "training.log_interval=1")
    assert_clean_error(result, "cannot write checkpoint", "step_0000002")
    logged = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]


FLAKY = """
import os

import torch
import torch.nn.functional as F

computed = 0


def build_model():
    return torch.nn.Linear(4, 1)


def build_dataset(split):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x.sum(-1, keepdim=True))


def loss(model, batch):
    global computed
    x, y = batch
    value = F.mse_loss(model(x), y)
    if x.is_meta or not torch.is_grad_enabled():  # the trainer's checks, not a step
        return value
    computed += 1
    return value * float("nan") if computed >= int(os.environ["NAN_FROM"]) else value  # this run's Nth step on
"""


def flaky_run(tmp_path, interval: int, max_steps: int, nan_from: int):
    """A run whose loss is nan from its `nan_from`th step on (keep_checkpoints 1), to its end or its error."""
    (tmp_path / "flaky.py").write_text(FLAKY)
    config = {
        "model": {"type": "python", "builder": "flaky:build_model"},
        "data": {"type": "python", "builder": "flaky:build_dataset"},
        "training": {
            "loss": "flaky:loss",
            "max_steps": max_steps,
            "checkpoint_interval": interval,
            "keep_checkpoints": 1,
            "micro_batch_size": 4,
            "output_dir": str(tmp_path / "out"),
        },
        "distributed": {"backend": "single"},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    return train(tmp_path / "run.yaml", 1, env={"NAN_FROM": str(nan_from)})


def test_a_loss_that_is_no_number_withdraws_the_checkpoint_it_trained_from(run_cli, tmp_path):
    """Step 5's loss is nan, checkpointed every step: the checkpoint of step 4, whose weights step 5 trained from, is
    withdrawn (its marker taken away), and the one of step 3 stays, though keep_checkpoints is 1: a checkpoint's
    older ones go only once the step after it has a loss that is a number (steps 1 and 2 went so). The run stops in
    one line, and a resume never starts from weights gone wrong."""
    result = flaky_run(tmp_path, interval=1, max_steps=6, nan_from=5)
    assert_clean_error(
        result, "the loss is nan at step 5, the first after the checkpoint of step 4, which is withdrawn"
    )
    checkpoints = tmp_path / "out" / "checkpoints"
    assert find_resume(checkpoints)[0] == step_dir(checkpoints, 3)
    listed = json.loads(run_cli("checkpoint", "ls", tmp_path / "out", "--json").stdout)
    assert [(c["step"], c["complete"], c["resume"]) for c in listed] == [(3, True, True), (4, False, False)]
    assert listed[1]["problem"] == "withdrawn: step 5, trained from its weights, has a loss of nan"
    assert "confirmed" not in json.loads((step_dir(checkpoints, 3) / "COMPLETE").read_text())  # checked at step 4
    exported = run_cli("checkpoint", "export", step_dir(checkpoints, 4), "-o", tmp_path / "exported")
    assert exported.exit_code == 1 and "was withdrawn: step 5" in exported.stderr


def test_a_checkpoint_step_whose_loss_is_no_number_writes_none(tmp_path):
    assert_clean_error(flaky_run(tmp_path, interval=3, max_steps=6, nan_from=3), "the loss is nan at step 3: the")
    assert not (tmp_path / "out" / "checkpoints").exists()


def make_weights_nan(checkpoint: Path, **marker_fields) -> None:
    """Every weight in a single-process checkpoint's state.pt nan, as an update gone wrong leaves them; its marker
    names the file's new size, and `marker_fields` besides."""
    import torch

    state = torch.load(checkpoint / "state.pt", weights_only=False)
    state["model"] = {name: torch.full_like(value, float("nan")) for name, value in state["model"].items()}
    torch.save(state, checkpoint / "state.pt")
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    files = {**marker["files"], "state.pt": (checkpoint / "state.pt").stat().st_size}
    (checkpoint / "COMPLETE").write_text(json.dumps({**marker, "files": files, **marker_fields}))


def test_a_run_resumed_from_an_unchecked_checkpoint_checks_it_at_its_first_step(tmp_path):
    """A stopped run's checkpoint (or one a crash left before the step after it) says confirmed: false; the run that
    resumes from it checks it with its first step's loss, and withdraws it where that is nan (here its weights are
    made nan by hand, as an update gone wrong at the stopping step leaves them)."""
    config = write_run_config(tmp_path, "single")
    settings = ("training.checkpoint_interval=1", "training.keep_checkpoints=1")
    assert train(config, 1, "training.max_steps=3", *settings).returncode == 0
    newest = step_dir(tmp_path / "out" / "checkpoints", 3)
    make_weights_nan(newest, confirmed=False)
    result = train(config, 1, "training.max_steps=5", *settings)
    assert_clean_error(
        result, "the loss is nan at step 4, the first after the checkpoint of step 3, which is withdrawn"
    )
    assert (newest / "WITHDRAWN").is_file() and find_resume(tmp_path / "out" / "checkpoints")[0] is None


def test_your_own_loss_of_nan_after_a_resume_names_the_checkpoint_it_trained_from(tmp_path):
    """data.type python: the first step's check of the user's loss says which checkpoint the run resumed from, whose
    weights (made nan by hand here) may be what gives no number, and how to resume from the one before it."""
    assert flaky_run(tmp_path, interval=2, max_steps=2, nan_from=99).returncode == 0
    newest = step_dir(tmp_path / "out" / "checkpoints", 2)
    make_weights_nan(newest)
    config = json.loads((tmp_path / "run.yaml").read_text())
    config["training"]["max_steps"] = 4
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    result = train(tmp_path / "run.yaml", 1, env={"NAN_FROM": "99"})
    assert_clean_error(result, f"flaky:loss returned a loss of nan at the first step after resuming from {newest}")
    assert "move that checkpoint aside to resume from the one before it" in result.stdout + result.stderr


def test_deepspeeds_latest_names_the_newest_complete_checkpoint_after_a_withdrawal(tmp_path):
    from distsetup.training.backends.deepspeed import point_latest_at_the_newest

    for step in (10, 20):
        step_dir(tmp_path, step).mkdir()
        marker = {"backend": "deepspeed", "step": step, "world_size": 1, "files": {}}
        (step_dir(tmp_path, step) / "COMPLETE").write_text(json.dumps(marker))
    (tmp_path / "latest").write_text(step_dir(tmp_path, 30).name)  # the withdrawn one
    point_latest_at_the_newest(tmp_path)
    assert (tmp_path / "latest").read_text() == step_dir(tmp_path, 20).name
    for step in (10, 20):
        (step_dir(tmp_path, step) / "COMPLETE").unlink()
    point_latest_at_the_newest(tmp_path)
    assert not (tmp_path / "latest").exists()


def test_the_step_cap_is_a_whole_number_or_one_line(monkeypatch, tmp_path):
    import pytest

    from distsetup.errors import DistsetupError
    from distsetup.training.run_length import STEP_CAP, run_steps, step_cap

    monkeypatch.setenv(STEP_CAP, "")
    assert step_cap() is None
    monkeypatch.setenv(STEP_CAP, "12")
    assert step_cap() == 12
    for value in ("0", "-3", "1e3", "ten"):
        monkeypatch.setenv(STEP_CAP, value)
        with pytest.raises(DistsetupError, match=f"DISTSETUP_MAX_STEPS is '{value}'"):
            step_cap()
    assert run_steps(100, None, 7, None) == (100, [])
    assert run_steps(100, 3, 7, 12)[0] == 12 and run_steps(100, 3, 7, 50)[0] == 21  # epochs first, then the cap
    # refused before the run takes its output folder (and its lock)
    result = train(write_run_config(tmp_path, "single"), 1, env={STEP_CAP: "ten"})
    assert_clean_error(result, STEP_CAP, "whole number")
    assert not (tmp_path / "out").exists()
    # a capped run (a smoke test) trains the whole run's first steps: its learning rate on the whole run's schedule
    import json

    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.optim import lr_lambda

    config = write_run_config(tmp_path / "capped", "single", max_steps=10, warmup_steps=2, log_interval=1)
    capped = train(config, 1, env={STEP_CAP: "4"})
    assert capped.returncode == 0 and "caps the run at 4 steps" in capped.stdout, capped.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "capped" / "out" / "metrics.jsonl").read_text().splitlines()]
    t = load_run_config(str(config)).training
    schedule = lr_lambda(t.warmup_steps, 10, t.min_lr_ratio)
    assert [row["lr"] for row in rows if "loss" in row] == pytest.approx([t.lr * schedule(s) for s in range(4)])


def test_init_from_weights_of_another_shape_is_one_line_naming_the_tensor(tmp_path):
    import torch

    from distsetup.training.checkpoint.export import load_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    built = model[0].bias.detach().clone()
    torch.save({"0.weight": torch.zeros(3, 5), "0.bias": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(
        DistsetupError, match=r"does not fit the model \(0.weight of shape \[3, 5\], the model's \[3, 4\]\)"
    ):
        load_weights(model, str(tmp_path / "other.pt"))
    assert torch.equal(model[0].bias, built)  # nothing loaded, not even the tensor that fits


def test_export_under_a_launcher_is_written_by_rank_0_alone(tmp_path, monkeypatch, capsys):
    from distsetup.train import main

    config = write_run_config(tmp_path, "single")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["--config", str(config), "--export", str(tmp_path / "model.pt")]) == 0
    finally:
        signal.signal(signal.SIGTERM, before)  # main() takes SIGTERM over, as a rank
    assert not (tmp_path / "model.pt").exists() and capsys.readouterr().out == ""  # no race with rank 0's write


SLOW = """
import time

import torch


def build_model():
    return torch.nn.Linear(4, 1)


def build_dataset(split):
    time.sleep(30)  # a run that hangs
"""


def test_a_run_that_hangs_fails_its_test_with_where_it_waits(tmp_path):
    """DISTSETUP_STACKS_AFTER_S (the tests set it below train()'s timeout): the run prints every thread's stack, and
    train() fails with the end of its output instead of a bare timeout. The stacks come every 2 s. A run still
    importing torch when stopped (a busy machine took more than 8 s) tries again, with three times the time."""
    from train_runs import STACKS_AFTER

    (tmp_path / "slow.py").write_text(SLOW)
    config = {
        "model": {"type": "python", "builder": "slow:build_model"},
        "data": {"type": "python", "builder": "slow:build_dataset"},
        "training": {"output_dir": str(tmp_path / "out")},
        "distributed": {"backend": "single"},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    for timeout in (8, 24):
        with pytest.raises(AssertionError, match=f"the run took more than {timeout} s") as failed:
            train(tmp_path / "run.yaml", 1, timeout=timeout, env={STACKS_AFTER: "2"})
        if "in build_dataset" in str(failed.value):
            break
    assert re.search(r'slow.py", line \d+ in build_dataset', str(failed.value)), str(failed.value)

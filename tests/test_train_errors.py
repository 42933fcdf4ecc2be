"""Bad input ends with one clear line and a non-zero status before any training starts."""

import json
import socket

import pytest
from train_runs import GLOBAL_BATCH, ds_file, train, write_run_config


def assert_clean_error(result, *words):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_missing_config(tmp_path):
    result = train(tmp_path / "nope.yaml")
    assert_clean_error(result, "nope.yaml")


def test_invalid_config(tmp_path):
    config = write_run_config(tmp_path, "single")
    result = train(config, 1, "training.learning_rate=0.1")
    assert_clean_error(result, "learning_rate")
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
    assert_clean_error(result, "backend single", "WORLD_SIZE is 2")


@pytest.mark.slow
def test_checkpoint_another_backend_wrote_into_deepspeed_runs_that_cannot_take_it(tmp_path):
    """Conversions load DeepSpeed's universal format, which a run offloading its optimizer to NVMe cannot; a
    DeepSpeed file's own scheduler cannot continue distsetup's schedule."""
    config = write_run_config(tmp_path, "single", max_steps=2, checkpoint_interval=2, warmup_steps=0)
    assert train(config, 1).returncode == 0
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text()
    one_rank = {**ds_file(2), "train_micro_batch_size_per_gpu": GLOBAL_BATCH}
    one_rank["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    (tmp_path / "ds.json").write_text(json.dumps(one_rank))
    result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert_clean_error(result, "(single, 1 rank); a run that offloads its optimizer to NVMe", "offload to cpu")
    one_rank["zero_optimization"].pop("offload_optimizer")
    one_rank["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(one_rank))
    result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert_clean_error(result, "the scheduler block of DeepSpeed file", "remove the scheduler block")
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == metrics  # nothing trained


@pytest.mark.slow
def test_checkpoint_of_a_model_of_another_shape(tmp_path):
    config = write_run_config(tmp_path, "single", max_steps=2, checkpoint_interval=2, warmup_steps=0)
    assert train(config, 1).returncode == 0
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text()
    result = train(config, 1, "model.n_layer=3")
    assert_clean_error(result, "holds a model with model.n_layer 2; this run config says 3", "trained with")
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == metrics  # nothing trained


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


def test_an_error_mid_training_closes_the_progress_bar_and_keeps_the_metrics(tmp_path):
    """Issue 11: when training raised, the progress bar was left open (the error line followed it on its line)
    and so was the metrics file. Here the checkpoint of step 2 cannot be written: a file is where it goes."""
    config = write_run_config(tmp_path, "single")
    checkpoints = tmp_path / "out" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_0000002").write_text("in the way")
    result = train(config, 1, "training.max_steps=4", "training.checkpoint_interval=2", "training.log_interval=1")
    assert_clean_error(result, "cannot write checkpoint", "step_0000002")
    logged = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]


@pytest.mark.slow
def test_a_plain_one_process_deepspeed_run_takes_a_free_port_not_29500(tmp_path):
    """DeepSpeed needs a process group for one process too; another job holding torch's default port 29500 on
    this machine does not stop a plain `python -m distsetup.train` run."""
    one_process = {**ds_file(2), "train_micro_batch_size_per_gpu": GLOBAL_BATCH}
    (tmp_path / "ds.json").write_text(json.dumps(one_process))
    config = write_run_config(tmp_path, "single", max_steps=2, checkpoint_interval=2, warmup_steps=0)
    with socket.socket() as other_job:
        try:
            other_job.bind(("127.0.0.1", 29500))
            other_job.listen()
        except OSError:  # something on this machine holds it already: as good
            pass
        result = train(config, 1, "--deepspeed", tmp_path / "ds.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (tmp_path / "out" / "metrics.jsonl").exists()

"""Bad input ends with one clear line and a non-zero status before any training starts."""

import json

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
    line = assert_clean_error(result, f"train_batch_size {GLOBAL_BATCH}", "world size 1")
    assert "= 8" in line
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
def test_checkpoint_from_another_backend(tmp_path):
    config = write_run_config(tmp_path, "single", max_steps=2, checkpoint_interval=2, warmup_steps=0)
    assert train(config, 1).returncode == 0
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text()
    result = train(config, 1, "distributed.backend=ddp")
    assert_clean_error(result, "written by backend single", "this run uses ddp")
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == metrics  # nothing trained

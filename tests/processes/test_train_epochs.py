"""training.epochs sets the run's length from the data (2 epochs of 12 steps: 24 steps), and the learning-rate
schedule spans the whole run."""

import json

import pytest


def test_epochs_set_the_run_length_and_the_schedule_spans_it(tmp_path):
    from train_runs import train, write_config

    from distsetup.training.optim import lr_lambda

    training = {"epochs": 2, "micro_batch_size": 8, "log_interval": 1, "lr": 1e-3, "warmup_steps": 2}
    config = write_config(tmp_path, "single", "single", None, training, data={"num_samples": 100})
    result = train(config, 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 epochs of 12 steps: 24 steps" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 25))
    decay = lr_lambda(2, 24, 0.1)  # the schedule of 24 steps, not of max_steps' default 200
    assert [row["lr"] for row in rows] == pytest.approx([1e-3 * decay(step) for step in range(24)], rel=1e-9)

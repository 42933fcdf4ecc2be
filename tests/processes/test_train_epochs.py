"""training.epochs sets the run's length from the data (2 epochs of 12 steps: 24 steps), and the learning-rate
schedule spans the whole run; resumed with another global batch, the epochs end where the data position says."""

import json
import shutil

import pytest

from distsetup.formats.checkpoint_folder import Marker


def test_epochs_set_the_run_length_and_the_schedule_spans_it(tmp_path):
    from train_runs import train, write_config

    from distsetup.training.optim import lr_lambda

    training = {
        "epochs": 2,
        "micro_batch_size": 8,
        "log_interval": 1,
        "lr": 1e-3,
        "warmup_steps": 2,
        "checkpoint_interval": 10,
    }
    config = write_config(tmp_path, "single", "single", None, training, data={"num_samples": 100})
    result = train(config, 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 epochs of 12 steps: 24 steps" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 25))
    decay = lr_lambda(2, 24, 0.1)  # the schedule of 24 steps, not of max_steps' default 200
    assert [row["lr"] for row in rows] == pytest.approx([1e-3 * decay(step) for step in range(24)], rel=1e-9)

    # resumed from step 10 (sample 80 of 100 in epoch 0) at global batch 12: 1 more step in epoch 0 (20 samples
    # left), 8 in epoch 1; counted as 2 epochs of 8 steps, the run stopped at step 16, 40 samples short of epoch 1
    shutil.rmtree(tmp_path / "out" / "checkpoints" / "step_0000020")
    shutil.rmtree(tmp_path / "out" / "checkpoints" / "step_0000024")
    config = write_config(
        tmp_path, "single", "single", None, {**training, "micro_batch_size": 12}, {"num_samples": 100}
    )
    resumed = train(config, 1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = "2 epochs: 19 steps (the checkpoint's 10, then 9 from its data position, 8 an epoch)"
    assert said in resumed.stdout
    marker = Marker.read(tmp_path / "out" / "checkpoints" / "step_0000019")
    assert marker.sampler == {"epoch": 1, "samples": 96, "global_batch": 12}  # the end of epoch 1: 4 samples left

"""The trainer on a CUDA GPU: one process, two steps (tests/conftest.py deselects this tier where torch sees no GPU)."""

import json
import math

from train_runs import losses, train, write_run_config


def test_two_steps_of_one_process_train_on_the_gpu(tmp_path):
    config = write_run_config(tmp_path, "single", max_steps=2, checkpoint_interval=2, warmup_steps=0)
    result = train(config, 1)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("backend ")]
    assert " on 1 x cuda; " in line, line
    curve = losses(tmp_path / "out")
    assert len(curve) == 2 and all(math.isfinite(loss) for loss in curve), curve
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["peak_device_bytes"] > 0  # None unless the run was on CUDA

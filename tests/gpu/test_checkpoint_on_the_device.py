"""A checkpoint written on the device resumes to the weights it saved: the resumed run's first loss is the
uninterrupted run's, on the device and on a machine without a GPU (CUDA_VISIBLE_DEVICES empty), which must map the
device's tensors to the CPU."""

import shutil

import pytest
from conftest import DEVICE
from test_backends_on_the_device import backend_files
from train_runs import losses, train, write_config

from distsetup.formats.checkpoint_folder import step_dir

TRAINING = {"max_steps": 3, "checkpoint_interval": 2, "log_interval": 1, "warmup_steps": 0, "micro_batch_size": 8}
TRAINING["precision"] = "fp32"


def resumed_from_step_2(original, folder, env=None) -> float:
    """The step-3 loss of a run that resumes `original`'s step-2 checkpoint in `folder` (its config beside it)."""
    checkpoints = folder / "out" / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copytree(step_dir(original / "out" / "checkpoints", 2), step_dir(checkpoints, 2))
    result = train(folder / "config.yaml", 1, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "resumed from" in result.stdout, result.stdout[-2000:]
    (loss,) = losses(folder / "out")
    return loss


@pytest.mark.parametrize("backend", ["single", "fsdp", "zero3"])
def test_a_device_checkpoint_resumes_to_the_weights_it_saved(tmp_path, backend, record):
    name, backend_file = backend_files(backend, "fp32")
    for run in ("whole", "resumed", "on_cpu"):
        write_config(tmp_path / run, backend, name, backend_file, TRAINING)
    result = train(tmp_path / "whole" / "config.yaml", 1, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    step_3 = losses(tmp_path / "whole" / "out")[2]
    resumed = resumed_from_step_2(tmp_path / "whole", tmp_path / "resumed")
    assert resumed == pytest.approx(step_3, rel=1e-6), "the resumed weights differ from the saved ones"
    on_cpu = resumed_from_step_2(tmp_path / "whole", tmp_path / "on_cpu", env={"CUDA_VISIBLE_DEVICES": ""})
    assert on_cpu == pytest.approx(step_3, rel=1e-4), f"resumed on the CPU from a {DEVICE} checkpoint"
    record(step_3_loss=step_3, resumed=resumed, resumed_on_cpu=on_cpu)

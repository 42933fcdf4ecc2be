"""training.async_checkpoint: the loop waits only for a copy; the files are written in the background and the
checkpoint counts (its COMPLETE marker) only once every rank's write is on disk, so a crash during a background
write leaves the previous checkpoint the newest complete one. What is written is the state at the checkpoint's
step, not the state the training reached while it was being written."""

import shutil
import threading

import pytest
import torch

from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import Marker, latest_complete, step_dir
from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.backends.single import SingleBackend
from distsetup.training.checkpoint.export import consolidated_state_dict
from distsetup.training.checkpoint.files import save_checkpoint, start_checkpoint
from distsetup.training.launch_env import World
from distsetup.training.loss.token_objective import TokenObjective
from distsetup.training.model import build as models

TINY = ["model.n_layer=1", "model.n_embd=32", "model.block_size=16"]


def train_one_step(backend: SingleBackend, cfg) -> None:
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    objective = TokenObjective(backend.model, "gpt", cfg.model.vocab_size, False, "model.type gpt")
    backend.backward(lambda model: objective.micro_loss(model, (x, x)), last_micro=True)
    backend.step()


def test_a_checkpoint_counts_only_once_its_background_write_is_done_and_holds_its_own_step(tmp_path):
    cfg = load_run_config(
        None, ["model.n_layer=1", "model.n_embd=32", "model.block_size=16", "training.warmup_steps=0"]
    )
    world = World(rank=0, local_rank=0, size=1, local_size=1)
    backend = SingleBackend(cfg, world, torch.device("cpu"))
    torch.manual_seed(0)
    model = models.build(cfg.model)
    backend.wrap(models.parts(model, cfg.model, ["Block"]), cfg.training.max_steps)
    root = tmp_path / "checkpoints"
    train_one_step(backend, cfg)
    save_checkpoint(backend, root, world, Marker("single", step=1, world_size=1))

    train_one_step(backend, cfg)
    at_step_2 = {k: v.clone() for k, v in model.state_dict().items()}
    gate = threading.Event()
    backend._in_background(gate.wait)  # the checkpoint thread is busy: the write of step 2 waits behind it
    pending = start_checkpoint(backend, root, world, Marker("single", step=2, world_size=1), None, background=True)
    assert not pending.written_here()
    assert latest_complete(root) == step_dir(root, 1)  # what a run killed now would resume from

    train_one_step(backend, cfg)  # training goes on while the write waits
    assert any(not torch.equal(v, at_step_2[k]) for k, v in model.state_dict().items())
    gate.set()
    pending.finish(world, backend)
    assert latest_complete(root) == step_dir(root, 2) and Marker.read(step_dir(root, 2)).step == 2
    written = consolidated_state_dict(step_dir(root, 2))
    assert all(torch.equal(written[k], v) for k, v in at_step_2.items())  # step 2's weights, not step 3's


def test_a_failed_background_write_is_one_line_and_leaves_the_checkpoint_incomplete(tmp_path):
    cfg = load_run_config(None, TINY)
    world = World(rank=0, local_rank=0, size=1, local_size=1)
    backend = SingleBackend(cfg, world, torch.device("cpu"))
    model = models.build(cfg.model)
    backend.wrap(models.parts(model, cfg.model, ["Block"]), cfg.training.max_steps)
    root = tmp_path / "checkpoints"
    gate = threading.Event()
    backend._in_background(gate.wait)
    pending = start_checkpoint(backend, root, world, Marker("single", step=1, world_size=1), None, background=True)
    shutil.rmtree(step_dir(root, 1))  # the folder vanishes (a cleanup script, a lost mount) before the write
    gate.set()
    with pytest.raises(DistsetupError) as raised:
        pending.finish(world, backend)
    assert f"cannot write checkpoint {step_dir(root, 1)}: Parent directory" in str(raised.value)
    assert latest_complete(root) is None


def test_dcp_failures_are_one_line_though_the_trainer_does_not_import_dcp(tmp_path):
    """DCP's CheckpointException is no Exception: disk_errors and read_errors still turn it into the one line, and a
    KeyboardInterrupt still goes through. Importing the trainer leaves DCP out (1.5 s of every run's start)."""
    import subprocess
    import sys

    from torch.distributed.checkpoint.api import CheckpointException

    from distsetup.training.checkpoint.export import read_errors
    from distsetup.training.checkpoint.files import disk_errors

    lean = "import sys, distsetup.training.trainer; sys.exit('torch.distributed.checkpoint' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", lean]).returncode == 0
    failure = CheckpointException("save", {0: (ValueError("disk gone"), None)})
    with pytest.raises(DistsetupError, match="cannot write checkpoint"):
        with disk_errors(tmp_path):
            raise failure
    with pytest.raises(DistsetupError, match="cannot load checkpoint"):
        with read_errors(tmp_path, "load"):
            raise failure
    with pytest.raises(KeyboardInterrupt):
        with disk_errors(tmp_path):
            raise KeyboardInterrupt

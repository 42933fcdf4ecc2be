"""How the trainer joins a job on GPUs, decided on any machine: the processes per node under each launcher, the
process group's backend (gloo beside NCCL where FSDP offloads to the CPU) and what NCCL's watchdog does with a
failed collective."""

import json

import pytest
import torch

from distsetup.formats.fsdp import FsdpSpec, build_fsdp_config
from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.backends import make_backend
from distsetup.training.launch_env import World, read_world
from distsetup.training.world import nccl_error_handling, process_group_backend

LAUNCHER_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


@pytest.mark.parametrize(
    "launcher_sets, local_size",
    [
        ({"LOCAL_WORLD_SIZE": "4"}, 4),  # torchrun
        ({"LOCAL_SIZE": "4"}, 4),  # the deepspeed launcher (launcher/launch.py)
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "4"}, 2),
        ({}, 8),  # neither: every rank on one node
    ],
)
def test_processes_per_node_under_each_launcher(monkeypatch, launcher_sets, local_size):
    for name in LAUNCHER_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", **launcher_sets}.items():
        monkeypatch.setenv(name, value)
    assert read_world() == World(rank=5, local_rank=1, size=8, local_size=local_size)


def backend_of(tmp_path, name: str, device: str, **fsdp) -> str:
    """The process group's backend for a run of backend `name` on `device` (FSDP: with `fsdp`'s settings)."""
    overrides = [f"distributed.backend={name}"]
    if name == "fsdp":
        (tmp_path / "fsdp.json").write_text(
            json.dumps(build_fsdp_config(FsdpSpec(transformer_layer_cls_to_wrap=("Block",), **fsdp)))
        )
        overrides.append(f"distributed.fsdp_config={tmp_path / 'fsdp.json'}")
    cfg = load_run_config(None, overrides)
    backend = make_backend(name, cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device(device))
    return process_group_backend(torch.device(device), backend.needs_cpu_collectives())


def test_fsdp_cpu_offload_on_gpus_reduces_cpu_tensors_over_gloo(tmp_path):
    """FSDP's CPU offload clips gradients living on the CPU: NCCL alone fails on them (pytorch#148532)."""
    assert backend_of(tmp_path, "fsdp", "cuda", cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_of(tmp_path, "fsdp", "cuda") == "nccl"
    assert backend_of(tmp_path, "ddp", "cuda") == "nccl"
    assert backend_of(tmp_path, "fsdp", "cpu", cpu_offload=True) == "gloo"  # nothing to offload to
    assert backend_of(tmp_path, "ddp", "cpu") == "gloo"


@pytest.mark.parametrize(
    "environ, added",
    [
        ({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),  # a plain, deepspeed-launched or srun run: torch's 3
        (
            {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_RUN_ID": "x"},
            {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"},
        ),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {}),  # the user's own
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCHELASTIC_RUN_ID": "x"}, {}),  # passed on by torchrun
        ({"NCCL_ASYNC_ERROR_HANDLING": "0"}, {}),  # the older name
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": ""}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
    ],
)
def test_nccl_errors_reach_the_trainer_unless_the_user_chose(environ, added):
    """CleanUpOnly (2): the watchdog aborts the communicators and the failed collective raises in the trainer, which
    says which rank it lost; 1 and 3 end the process from the watchdog before it can."""
    assert nccl_error_handling(environ) == added


@pytest.mark.parametrize(
    "environment, said",
    [
        ({}, None),
        ({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, None),  # a first start says 0
        ({"SLURM_RESTART_COUNT": "2"}, "SLURM requeued the job (SLURM_RESTART_COUNT=2)"),
        ({"TORCHELASTIC_RESTART_COUNT": "1"}, "torchrun restarted (TORCHELASTIC_RESTART_COUNT=1)"),
    ],
)
def test_a_restart_with_the_first_starts_command_line_is_known(monkeypatch, environment, said):
    """What makes --no_resume apply to the first start only: a requeued job with it started over each time."""
    from distsetup.training.launch_env import RESTART_COUNTS, restarted_by

    for name in RESTART_COUNTS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert restarted_by() == said

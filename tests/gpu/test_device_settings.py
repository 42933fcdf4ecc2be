"""The trainer's device-dependent settings, in-process on the device: the step timer waits for queued GPU work, the
process group of a run that offloads reduces CPU tensors beside NCCL, NCCL errors reach the trainer, and fp32 runs
use TF32 matmuls on an Ampere or newer GPU (the dry run: the same calls on the CPU, where each is a no-op)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE

from distsetup.training.backends.precision import tf32_matmuls
from distsetup.training.launch_env import World
from distsetup.training.metrics import StepTimer
from distsetup.training.world import destroy_process_group, init_process_group, synchronizer


def test_a_step_is_timed_with_its_queued_device_work(record):
    device = torch.device(DEVICE)
    a = torch.randn(4096, 4096, device=device)
    a = (a @ a).tanh()  # the first product's one-off costs (cuBLAS's handle, the kernels' loading) out of the timing
    synchronizer(device)()
    timer = StepTimer(synchronizer(device))
    began = time.perf_counter()
    for _ in range(50 if DEVICE == "cuda" else 1):  # about 0.2 s of matrix products on a GPU
        a = (a @ a).tanh()
    queued = time.perf_counter() - began
    timer.step_done()
    (step,) = timer.recent_steps
    assert step >= queued
    if DEVICE == "cuda":  # without the synchronisation the step is the queueing: a few milliseconds
        assert step > 5 * queued, (step, queued)
    record(step_seconds=step, queueing_seconds=queued)


@pytest.mark.parametrize("cpu_collectives", [True, False])
def test_the_process_group_reduces_cpu_tensors_only_where_the_run_needs_it(cpu_collectives, monkeypatch, record):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    init_process_group(World(0, 0, 1, 1), torch.device(DEVICE), 1, cpu_collectives=cpu_collectives)
    try:
        on_cpu = torch.ones(2)
        if DEVICE == "cpu" or cpu_collectives:
            dist.all_reduce(on_cpu)
            assert on_cpu.tolist() == [1.0, 1.0]
        else:  # NCCL alone has no backend for CPU tensors (pytorch#148532)
            with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
                dist.all_reduce(on_cpu)
        if DEVICE == "cuda":
            assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
            on_gpu = torch.ones(2, device="cuda")
            dist.all_reduce(on_gpu)
            assert on_gpu.tolist() == [1.0, 1.0]
        record(backend=str(dist.get_backend()))
    finally:
        destroy_process_group()


def test_fp32_matmuls_in_tf32_only_on_a_gpu_that_has_it(record):
    device = torch.device(DEVICE)
    wanted = tf32_matmuls(device, "fp32", {})
    if DEVICE == "cuda":
        assert wanted == (torch.cuda.get_device_capability() >= (8, 0))
    else:
        assert not wanted
    assert not tf32_matmuls(device, "bf16", {}) and not tf32_matmuls(device, "fp32", {"NVIDIA_TF32_OVERRIDE": "0"})
    record(tf32=wanted)

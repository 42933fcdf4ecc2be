"""Precision on a GPU, decided where it can be on any machine: one bf16 rule for every backend (a GPU that only
emulates bf16 is refused), and the backend line saying when an fp32 run's matmuls use TF32."""

import json

import pytest
import torch
from train_runs import ds_file

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.backends import make_backend
from distsetup.training.backends.precision import tf32_matmuls
from distsetup.training.launch_env import World

WORLD = World(rank=0, local_rank=0, size=2, local_size=2)


@pytest.fixture
def gpu_that_emulates_bf16(monkeypatch):
    """torch's answers on a V100 or T4: bf16 only with emulation counted in (no such GPU here, so torch is told)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)


def test_deepspeed_refuses_emulated_bf16_as_every_backend_does(tmp_path, gpu_that_emulates_bf16):
    """DeepSpeed's accelerator asks torch with emulation counted in, and would train a V100 in emulated bf16."""
    (tmp_path / "ds.json").write_text(json.dumps({**ds_file(1), "bf16": {"enabled": True}}))
    cfg = load_run_config(
        None, ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'ds.json'}"]
    )
    backend = make_backend("deepspeed", cfg, WORLD, torch.device("cuda"))
    assert backend.precision == "bf16"
    with pytest.raises(DistsetupError, match="enables bf16"):
        backend.check_device_support()
    ddp = make_backend(
        "ddp",
        load_run_config(None, ["distributed.backend=ddp", "training.precision=bf16"]),
        WORLD,
        torch.device("cuda"),
    )
    with pytest.raises(DistsetupError, match="asks for bf16"):  # the same rule
        ddp.check_device_support()


def test_tf32_only_for_fp32_on_a_gpu_unless_nvidia_turns_it_off():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not tf32_matmuls(cpu, "fp32", {})
    assert not tf32_matmuls(cuda, "bf16", {})
    assert not tf32_matmuls(cuda, "fp32", {"NVIDIA_TF32_OVERRIDE": "0"})  # cuBLAS would compute full fp32 anyway


def test_the_backend_line_says_tf32():
    backend = make_backend("single", load_run_config(None, []), World(0, 0, 1, 1), torch.device("cpu"))
    backend.set_up_device()
    assert "; fp32; " in backend.line()  # a CPU run: plain fp32
    backend.tf32 = True  # what set_up_device decides for an fp32 run on an Ampere or newer GPU
    assert "; fp32 (TF32 matmuls); " in backend.line()

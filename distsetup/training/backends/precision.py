"""The run's precision on its device: the dtypes, which precisions a device trains in, and whether fp32's matmuls
go to TF32. One rule for every backend."""

from collections.abc import Mapping

import torch

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_supports(device: torch.device, precision: str) -> bool:
    """Whether `device` trains in `precision`: on a GPU, bf16 only where the GPU has it (Ampere or newer), not
    emulated (torch.cuda.is_bf16_supported's default lets a V100 or T4 emulate it, far slower)."""
    on_gpu = device.type == "cuda"
    return not (on_gpu and precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False))


def tf32_matmuls(device: torch.device, precision: str, environ: Mapping[str, str]) -> bool:
    """Whether an fp32 run's matmuls go to TF32: on an Ampere or newer GPU, unless NVIDIA_TF32_OVERRIDE=0 (which makes
    cuBLAS and cuDNN compute full fp32 whatever torch asks)."""
    if device.type != "cuda" or precision != "fp32" or environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)

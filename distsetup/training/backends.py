"""The backends by name: `make_backend(name, cfg, world, device)`. Each is imported only when chosen (FSDP and
DeepSpeed take seconds to import)."""

import importlib

from distsetup.errors import DistsetupError
from distsetup.training.backend import Backend

BACKENDS = {  # name -> "module:class" under distsetup.training
    "single": "backend:Backend",
    "ddp": "ddp:DDPBackend",
    "fsdp": "fsdp:FSDPBackend",
    "deepspeed": "deepspeed_backend:DeepSpeedBackend",
}


def make_backend(name: str, cfg, world, device) -> Backend:
    if name not in BACKENDS:
        raise DistsetupError(f"unknown backend {name}.", f"use one of {', '.join(BACKENDS)}.")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(f"distsetup.training.{module}"), cls)(cfg, world, device)

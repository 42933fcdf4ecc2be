"""The backends: how a model is placed on the ranks, how its gradients meet and how its checkpoints are written.

`base.py` is the interface and what the backends share; `single.py` (one process holding the whole model),
`ddp.py`, `fsdp.py` (FSDP2) and `deepspeed.py` (ZeRO 0-3) subclass it. `make_backend(name, ...)` picks one by name
and imports only that one (FSDP and DeepSpeed take seconds to import).

May import: the training layer's base modules, model/, data/, loss/ and checkpoint/; nothing imports backends/
but the trainer and its model set-up (training/model_setup.py).
"""

import importlib

import torch

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import RunConfig
from distsetup.training.backends.base import Backend
from distsetup.training.launch_env import World

BACKENDS = {  # name -> "module:class" under distsetup.training.backends
    "single": "single:SingleBackend",
    "ddp": "ddp:DDPBackend",
    "fsdp": "fsdp:FSDPBackend",
    "deepspeed": "deepspeed:DeepSpeedBackend",
}


def make_backend(name: str, cfg: RunConfig, world: World, device: torch.device) -> Backend:
    if name not in BACKENDS:
        raise DistsetupError(f"unknown backend {name}.", f"use one of {', '.join(BACKENDS)}.")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(f"distsetup.training.backends.{module}"), cls)(cfg, world, device)

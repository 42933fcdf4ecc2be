"""One process holding the whole model, without a process group."""

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import RunConfig
from distsetup.training.backends.base import Backend
from distsetup.training.launch_env import World


class SingleBackend(Backend):
    name = "single"
    needs_process_group = False

    def __init__(self, cfg: RunConfig, world: World, device: torch.device) -> None:
        if world.size > 1:
            raise DistsetupError(
                f"backend single runs one process, but WORLD_SIZE is {world.size}.",
                "set distributed.backend to ddp, fsdp or deepspeed, or launch one process.",
            )
        super().__init__(cfg, world, device)

    def _handle_conditional(self, layers: list[nn.Module]) -> None:
        """One process: every layer's gradients are its own; an expert that ran on no micro-batch of a step gets a
        zero gradient, as under FSDP2 and ZeRO."""
        self.unrouted_as_zero = layers

"""One process holding the whole model, without a process group."""

import torch
import torch.nn as nn

from distsetup.formats.runconfig import RunConfig
from distsetup.formats.settle import settle
from distsetup.training.backends.base import Backend
from distsetup.training.launch_env import World


class SingleBackend(Backend):
    name = "single"
    needs_process_group = False

    def __init__(self, cfg: RunConfig, world: World, device: torch.device) -> None:
        settled = settle(cfg, None, None, world.size)
        if settled.problems:  # a world of several
            raise settled.problems[0].as_error()
        super().__init__(cfg, world, device, settled)

    def _handle_conditional(self, layers: list[nn.Module]) -> None:
        """One process: every layer's gradients are its own; an expert that ran on no micro-batch of a step gets a
        zero gradient, as under FSDP2 and ZeRO."""
        self.unrouted_as_zero = layers

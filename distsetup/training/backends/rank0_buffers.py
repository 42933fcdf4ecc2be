"""Buffers a forward may change (BatchNorm's running statistics, anything in a user's own module) kept equal on every
rank, as DDP keeps them: rank 0's broadcast before the first forward after each step's synchronised one (the next
step's first micro-batch, or an evaluation's first batch). DDP does it itself (forward_sync_buffers); FSDP2 and
DeepSpeed's engine do not, and each rank's statistics would drift apart: evaluation would average the ranks' own,
while checkpoints and exports hold rank 0's."""

import torch
import torch.distributed as dist
import torch.nn as nn

from distsetup.training.model.running_statistics import keeps_running_statistics

# the size of the flat buffers the broadcast goes through (DDP's default bucket)
BROADCAST_BUCKET_BYTES = 25 * 1024 * 1024


def buffers_may_change(model: nn.Module, model_type: str) -> bool:
    """Whether training may change the model's buffers: BatchNorm's running statistics change, and so may anything in
    the user's own module; the built-in GPT's and a Hugging Face causal LM's buffers (causal masks, rotary
    frequencies) are constants every rank builds alike. Broadcasting them costs a collective a step (about 8% of a
    tiny Llama's step on 2 CPU processes)."""
    return model_type == "python" or any(keeps_running_statistics(module) for module in model.modules())


class Rank0Buffers:
    """The hook on the module every forward goes through; `due` as DDP's require_forward_param_sync."""

    def __init__(self, model: nn.Module):
        self.due = True
        model.register_forward_pre_hook(self._take_rank0s)

    def step_synchronised(self) -> None:
        """A forward whose gradients are synchronised (a step's last micro-batch) ran: the next forward takes rank 0's
        buffers first."""
        self.due = True

    def _take_rank0s(self, module: nn.Module, args: tuple) -> None:
        if not self.due:
            return
        self.due = False
        buffers = list(module.buffers())  # as they are now (a checkpoint's load copies into them, or replaces them)
        # hidden from autograd, as DDP does it: a forward whose backward is still to come may have saved them
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            world = dist.distributed_c10d._get_default_group()
            dist._broadcast_coalesced(world, buffers, BROADCAST_BUCKET_BYTES, 0)


def kept_equal(model: nn.Module, model_type: str, world_size: int) -> Rank0Buffers | None:
    """Rank 0's buffers taken before the forwards DDP would take them in, where they may change and there are other
    ranks; None where not."""
    if world_size == 1 or next(model.buffers(), None) is None or not buffers_may_change(model, model_type):
        return None
    return Rank0Buffers(model)

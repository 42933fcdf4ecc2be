"""Buffers a forward may change (BatchNorm's running statistics, anything in a user's own module) kept equal on every
rank, as DDP keeps them: rank 0's broadcast before each forward, training's and evaluation's. DDP does it itself
(forward_sync_buffers); FSDP2 and DeepSpeed's engine do not, and each rank's statistics would then drift apart:
evaluation would average the ranks' own, while checkpoints and exports hold rank 0's."""

import torch
import torch.distributed as dist
import torch.nn as nn

# the size of the flat buffers the broadcast goes through (DDP's default bucket)
BROADCAST_BUCKET_BYTES = 25 * 1024 * 1024


def buffers_may_change(model: nn.Module, model_type: str) -> bool:
    """Whether training may change the model's buffers: BatchNorm's running statistics change, and so may anything in
    the user's own module; the built-in GPT's and a Hugging Face causal LM's buffers (causal masks, rotary
    frequencies) are constants every rank builds alike. Broadcasting them costs a collective per micro-batch (about
    8% of a tiny Llama's step on 2 CPU processes)."""
    running_stats = any(getattr(module, "track_running_stats", False) for module in model.modules())
    return model_type == "python" or running_stats


def broadcast_before_each_forward(model: nn.Module, model_type: str, world_size: int) -> bool:
    """Hook `model` (the module every forward goes through) to take rank 0's buffers first, where they may change
    and there are other ranks; whether it did."""
    if world_size == 1 or not any(True for _ in model.buffers()) or not buffers_may_change(model, model_type):
        return False

    def take_rank0s(module: nn.Module, args: tuple) -> None:
        with torch.no_grad():  # the buffers as they are now (a checkpoint's load copies into them, or replaces them)
            world = dist.distributed_c10d._get_default_group()
            dist._broadcast_coalesced(world, list(module.buffers()), BROADCAST_BUCKET_BYTES, 0)

    model.register_forward_pre_hook(take_rank0s)
    return True

"""The validation loss: every rank evaluates its share of the validation blocks, and one all-reduce sums the
losses and the counted targets of all ranks, so the mean is over every target of the set however it was split."""

import math

import torch
import torch.distributed as dist

from distsetup.training.data import TokenBlocks


def evaluate(backend, val: TokenBlocks, rank: int, world_size: int, device: torch.device) -> dict[str, float]:
    """{"val_loss", "val_perplexity"} of the validation set `val`; every rank calls it at the same step."""
    mine = torch.arange(rank, len(val), world_size)  # blocks rank, rank + world, ...
    micro = backend.micro_batch
    most = math.ceil(len(val) / world_size)  # what the rank with the most blocks holds
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for start in range(0, most, micro):
        idx = mine[start : start + micro]
        counted = len(idx) > 0
        if not counted:  # this rank is out of blocks; FSDP and ZeRO-3 still gather parameters with the others
            idx = mine[:1]
        x, y = val.batch(idx)
        loss, targets = backend.evaluate(x.to(device), y.to(device))
        if counted:
            totals += torch.stack([loss.double(), targets.double()])
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, targets = totals.tolist()
    mean = loss_sum / targets
    return {"val_loss": mean, "val_perplexity": math.exp(min(mean, 700.0))}

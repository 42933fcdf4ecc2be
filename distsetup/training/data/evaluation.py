"""The validation loss: every rank evaluates its share of the validation set, and one all-reduce sums the losses and
the counted items (targets of token data, samples of the user's) of all ranks, so the mean is over every item of the
set however it was split."""

import functools
import math
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from distsetup.training.data.loader import Placement, validation_batches
from distsetup.training.launch_env import World

T = TypeVar("T")


class Evaluating(Protocol):
    """What evaluation asks of a backend (training/backends/base.py)."""

    placement: Placement
    micro_batch: int

    def evaluate(self, compute: Callable[[nn.Module], T]) -> T: ...


def evaluate(backend: Evaluating, objective, data, world: World, num_workers: int) -> dict[str, float]:
    """{"val_loss"} of `data.val` (and "val_perplexity" for tokens); every rank calls it at the same step."""
    placement = backend.placement
    totals = torch.zeros(2, dtype=torch.float64, device=placement.device)
    batches = validation_batches(
        data.val, backend.micro_batch, world.rank, world.size, data.collate, num_workers, placement
    )
    for batch, samples in batches:
        loss, counted = backend.evaluate(functools.partial(objective.eval_sums, batch=batch, samples=samples))
        if samples:  # a rank out of samples ran its first one again, for the others' gathers
            totals += torch.stack([loss.double(), counted.double()])
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, counted = totals.tolist()
    mean = loss_sum / counted
    if objective.unit != "tokens":
        return {"val_loss": mean}
    return {"val_loss": mean, "val_perplexity": math.exp(min(mean, 700.0))}

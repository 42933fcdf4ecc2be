"""The validation loss (and the terms the user's loss logs beside it): every rank evaluates its share of the
validation set, and one all-reduce sums the losses and the counted items (targets of token data, samples of the
user's) of all ranks, so the mean is over every item of the set however it was split. A stop (preemption, Ctrl-C)
ends it within about a second, as it ends training: the ranks agree on it between batches."""

import functools
import math
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.training.data.loader import Placement, validation_batches
from distsetup.training.launch_env import World
from distsetup.training.world import StepAgreement

T = TypeVar("T")


class Evaluating(Protocol):
    """What evaluation asks of a backend (training/backends/base.py)."""

    placement: Placement
    micro_batch: int

    def evaluate(self, compute: Callable[[nn.Module], T]) -> T: ...


def evaluate(
    backend: Evaluating,
    objective,
    data,
    world: World,
    num_workers: int,
    stop_requested: Callable[[], bool] = lambda: False,
) -> dict[str, float] | None:
    """{"val_loss"} of `data.val`, "val_perplexity" for tokens, "val_<name>" for each other term the user's loss
    logs; every rank calls it at the same step. None where the ranks agreed to stop before its end (a signal reached
    one: `stop_requested`)."""
    placement = backend.placement
    names: list[str] = []  # "loss", then the user's terms, as its first batch returns them
    totals = torch.zeros(0, dtype=torch.float64, device=placement.device)
    batches = validation_batches(
        data.val, backend.micro_batch, world.rank, world.size, data.collate, num_workers, placement, data.collating
    )
    agreement, started = StepAgreement(world.size, placement.device), time.perf_counter()
    try:
        for number, (batch, samples) in enumerate(batches, start=1):
            sums, counted = backend.evaluate(functools.partial(objective.eval_sums, batch=batch, samples=samples))
            if not names:
                names, totals = list(sums), torch.zeros(len(sums) + 1, dtype=torch.float64, device=placement.device)
            elif list(sums) != names:
                raise DistsetupError(
                    f"training.loss returned the terms {', '.join(names)} for one validation batch and "
                    f"{', '.join(sums)} for another.",
                    "return the same terms for every batch.",
                )
            if samples:  # a rank out of samples ran its first one again, for the others' gathers
                # each term a tensor of one number, as the first step checked: [1] as well as 0-d
                totals += torch.stack(
                    [*(sums[name].double().reshape(()) for name in names), counted.double().reshape(())]
                )
            if agreement.due(number):  # after the first batch, then about once a second: every rank at the same one
                seconds = (time.perf_counter() - started) / number
                if agreement.agree(number, {}, stop_requested(), seconds, False)[1]:
                    return None
    finally:  # its DataLoader's workers stopped, also where a batch raised (validation_batches)
        batches.close()
    if dist.is_initialized():
        dist.all_reduce(totals)
    *term_sums, counted = totals.tolist()
    means = {f"val_{name}": term / counted for name, term in zip(names, term_sums, strict=True)}
    if objective.unit == "tokens":
        means["val_perplexity"] = math.exp(min(means["val_loss"], 700.0))
    return means

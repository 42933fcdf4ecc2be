"""One micro-batch's loss as every objective returns it (MicroLoss), a step's mean of them, and the rules all
objectives share: what a loss is (a floating-point tensor of one number), how a micro-batch's weighs."""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MicroLoss:
    """One micro-batch's loss: `loss`, what backward takes; `parts`, the terms logged beside it (ce_loss, aux_loss)."""

    loss: torch.Tensor
    parts: dict[str, torch.Tensor]

    def detached(self) -> "MicroLoss":
        return MicroLoss(self.loss.detach(), {k: v.detach() for k, v in self.parts.items()})


def mean_terms(micro_losses: list[MicroLoss]) -> dict[str, torch.Tensor]:
    """A step's loss and its logged parts, each the mean over its micro-batches (still on the device)."""
    terms = {"loss": torch.stack([micro.loss for micro in micro_losses]).mean()}
    for name in micro_losses[0].parts:
        terms[name] = torch.stack([micro.parts[name] for micro in micro_losses]).mean()
    return terms


def is_scalar_loss(value) -> bool:
    """Whether `value` is what backward takes as a loss, or logs as a term: a floating-point tensor of one number."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def weighted(loss: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """`loss` x `weight`, without an operation in the graph for a weight of 1 (every step of unmasked data). A tensor
    weight (step_weights of masked data, a batch's counted labels) of 0 gives 0, not 0 x the mean over no labels
    (nan; its gradient is 0 either way). It is never read on the host, which would make the host wait for the device;
    it is cast to the loss's dtype, as a Python float is (the same product, and the loss keeps its dtype)."""
    if isinstance(weight, torch.Tensor):
        return torch.where(weight > 0, loss * weight.to(loss.dtype), 0.0)
    return loss if weight == 1.0 else loss * weight


def in_training(model: Any) -> bool:
    """The mode a call runs in (a callable that is no module, as some tests pass: training)."""
    return bool(getattr(model, "training", True))

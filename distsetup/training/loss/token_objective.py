"""Token data's loss: the next-token cross-entropy of the model's logits (or of its output head, a slice of the
vocabulary at a time: sliced.py), plus the model's auxiliary loss; its first call in each mode checked."""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsetup.errors import DistsetupError
from distsetup.training import user_code
from distsetup.training.data.datasets import IGNORE, loss_weights
from distsetup.training.loss.first_step_errors import mixed_dtypes_fix, rejected_input
from distsetup.training.loss.micro_loss import MicroLoss, in_training, is_scalar_loss, weighted
from distsetup.training.loss.model_outputs import field_of, forward_kwargs, terms_left_out
from distsetup.training.loss.sliced import LossHead, targets_for


class TokenObjective:
    """Next-token cross-entropy of a model that returns logits (see the module's docstring)."""

    unit = "tokens"

    def __init__(
        self,
        model: nn.Module,
        model_type: str,
        vocab_size: int,
        masked: bool,
        source: str,
        head: LossHead | None = None,
    ):
        """`head`: the model's output head computing the loss in slices (loss_head), or None: from the logits."""
        self.vocab_size, self.masked, self.source, self.head = vocab_size, masked, source, head
        self._checked_in: set[bool] = set()  # the modes (model.training) whose first call was checked
        self.weights_cast: str | None = None  # Backend.weights_cast_without_autocast
        self.say: Callable[[str], None] = lambda line: None  # the trainer's (rank 0 prints)
        self.forward_kwargs = forward_kwargs(model, model_type)
        config: Any = getattr(model, "config", None)
        self.aux_weight = float(config.router_aux_loss_coef) if "output_router_logits" in self.forward_kwargs else 1.0

    def micro_loss(self, model: nn.Module, batch, weight: float | torch.Tensor = 1.0) -> MicroLoss:
        """The micro-batch's mean cross-entropy x `weight` (step_weights), plus its auxiliary loss if any."""
        x, y = batch
        ce, aux = self._cross_entropy(model, x, y, "mean")
        ce = weighted(ce, weight)
        if aux is None:
            return MicroLoss(ce, {})
        parts = {"ce_loss": ce.detach(), "aux_loss": aux.detach()}  # loss = ce_loss + coefficient x aux_loss
        return MicroLoss(ce + self.aux_weight * aux, parts)

    def eval_sums(self, model: nn.Module, batch, samples: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The summed cross-entropy of a validation micro-batch over its counted targets ({"loss"}), and their
        number."""
        x, y = batch
        return {"loss": self._cross_entropy(model, x, y, "sum")[0]}, (y != IGNORE).sum()

    def unchecked_loss(self, model: nn.Module, batch) -> torch.Tensor:
        """The micro-batch's loss without the first call's checks (which read values: a FLOP count runs on meta)."""
        x, y = batch
        logits, aux = self._forward(model, x, check=False)
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        return ce if aux is None else ce + self.aux_weight * aux

    def _cross_entropy(self, model: nn.Module, x, y, reduction: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cross-entropy of the targets `y` (their mean or sum) and the model's auxiliary loss, if any."""
        if self.head is None:
            logits, aux = self._forward(model, x)
            return F.cross_entropy(
                logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction=reduction
            ), aux
        with targets_for(self.head, y):
            outputs = model(x, **self.forward_kwargs)
        total = field_of(outputs, "logits", outputs)  # what the head returned: the summed cross-entropy
        return total if reduction == "sum" else total / (y != IGNORE).sum(), field_of(outputs, "aux_loss", None)

    def step_weights(self, batches: list, world_size: int, device: torch.device) -> Sequence[float | torch.Tensor]:
        """Each micro-batch's loss weight: 1, or where some targets carry no loss (instruction data), its share of the
        step's counted targets (data.loss_weights), a 0-d tensor on the device (reading it would make the host wait
        for the device)."""
        if not self.masked:
            return [1.0] * len(batches)
        return loss_weights([y for _, y in batches], world_size, device).unbind()

    def _forward(self, model: nn.Module, x: torch.Tensor, check=True) -> tuple[torch.Tensor, torch.Tensor | None]:
        checking = check and in_training(model) not in self._checked_in
        try:
            outputs = model(x, **self.forward_kwargs)
        except Exception as e:
            if not (checking and rejected_input(e)):
                raise
            what = user_code.what_raised(e)
            raise DistsetupError(
                f"{self.source}'s model rejected the first {'' if in_training(model) else 'validation '}batch of token "
                f"data, input ids of shape {list(x.shape)}, "
                f"called as model(input_ids): {what}.",
                mixed_dtypes_fix(e, self.weights_cast)
                or "make its forward take the input ids first (forward(input_ids) -> logits), or compute the loss in "
                "training.loss.",
                alike_on_every_rank=True,
            ) from e
        logits, aux = field_of(outputs, "logits", outputs), field_of(outputs, "aux_loss", None)
        if checking:
            self._check(logits, aux if in_training(model) else None, x)  # evaluation adds no aux_loss
            if in_training(model) and (left_out := terms_left_out(outputs)):
                self.say(
                    f"note: {self.source}'s model returned {', '.join(left_out)} beside its logits: the next-token "
                    f"loss leaves {'it' if len(left_out) == 1 else 'them'} out (it adds aux_loss only); return "
                    f"{'it' if len(left_out) == 1 else 'them'} in aux_loss, weighted inside the model, or compute the "
                    "loss in training.loss"
                )
            self._checked_in.add(in_training(model))
        return logits, aux

    def _check(self, logits, aux, x: torch.Tensor) -> None:
        if aux is not None and not is_scalar_loss(aux):
            given = f"a tensor of shape {list(aux.shape)}" if isinstance(aux, torch.Tensor) else type(aux).__name__
            raise DistsetupError(
                f"{self.source}'s model returned {given} as its aux_loss, not a floating-point scalar tensor (it is "
                "added to the cross-entropy).",
                "return the auxiliary loss as one number (its mean over the batch, e.g. kl.mean()).",
                alike_on_every_rank=True,
            )
        expected = f"[{x.shape[0]}, {x.shape[1]}, {self.vocab_size} or more]"
        shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != x.shape:
            raise DistsetupError(
                f"{self.source}'s model returned {shape} for input ids of shape {list(x.shape)}; with token data its "
                f"forward(input_ids) returns the logits {expected}.",
                "return the logits (or an object or dict with `logits`), or compute the loss in training.loss.",
                alike_on_every_rank=True,
            )
        if logits.shape[-1] < self.vocab_size:
            raise DistsetupError(
                f"{self.source}'s model returned logits over {logits.shape[-1]} ids, fewer than model.vocab_size "
                f"{self.vocab_size} (the ids the data holds).",
                "make its output layer model.vocab_size wide, or lower model.vocab_size.",
                alike_on_every_rank=True,
            )

"""The loss of the user's own data: training.loss(model, batch), or the model's own (`.loss`, the Hugging Face
convention), with the terms logged beside it; its first call in each mode checked, in one line naming the setting to
fix."""

import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.training import user_code
from distsetup.training.data.datasets import IGNORE, loss_weights
from distsetup.training.loss.first_step_errors import described_batch, mixed_dtypes_fix, rejected_input
from distsetup.training.loss.micro_loss import MicroLoss, in_training, is_scalar_loss, weighted
from distsetup.training.loss.model_outputs import field_of


class PythonObjective:
    """The loss of the user's own data: training.loss, or the model's own (see the module's docstring; a Hugging Face
    model is called as for token data, its router loss in `.loss` where it is an MoE given labels)."""

    unit = "samples"

    def __init__(
        self,
        loss: Callable | None,
        loss_source: str | None,
        model_source: str,
        forward_kwargs: dict,
        counted_labels: Callable[[dict], torch.Tensor] | None = None,
    ):
        """`counted_labels`: where the loss is the model's own mean over a batch's labels (labels_averaged), the
        labels it counts; None: a micro-batch's loss weighs as much as its samples."""
        self.loss, self.loss_source, self.model_source = loss, loss_source, model_source
        # the modes (model.training) whose first call was checked: evaluation may take other paths (a term computed in
        # training only, a forward's branch for sampling), found at its first batch rather than as a traceback
        self._checked_in: set[bool] = set()
        self.forward_kwargs, self.counted_labels = forward_kwargs, counted_labels
        self.resumed_from: Path | None = None  # the checkpoint this run's first step trains from, where it resumed
        self.weights_cast: str | None = None  # Backend.weights_cast_without_autocast

    def micro_loss(self, model: nn.Module, batch, weight: float | torch.Tensor = 1.0) -> MicroLoss:
        loss, parts = self._loss(model, batch)
        return MicroLoss(weighted(loss, weight), {name: part.detach() for name, part in parts.items()})

    def eval_sums(self, model: nn.Module, batch, samples: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A validation micro-batch's mean loss, and each term logged beside it (training.loss's other entries, an
        aux_loss), x what they average (its counted labels, or its samples), and their number: summed over ranks
        and batches, the means over the whole validation set. {"loss": ..., "accuracy": ...}."""
        loss, parts = self._loss(model, batch)
        terms = {"loss": loss, **parts}
        if self.counted_labels is not None:
            counted = self._label_count(batch).to(loss.device)
            return {name: weighted(term.detach(), counted) for name, term in terms.items()}, counted
        return {name: term.detach() * samples for name, term in terms.items()}, torch.tensor(
            samples, device=loss.device
        )

    def unchecked_loss(self, model: nn.Module, batch) -> torch.Tensor:
        """The micro-batch's loss without the first call's checks (which read values: a FLOP count runs on meta)."""
        return self._compute(model, batch)[0]

    def step_weights(self, batches: list, world_size: int, device: torch.device) -> Sequence[float | torch.Tensor]:
        """Each micro-batch's loss weight: its share of the step's counted labels where the loss is their mean (as
        the HF Trainer's num_items_in_batch makes it), else 1 (micro-batches of as many samples)."""
        if self.counted_labels is None:
            return [1.0] * len(batches)
        # every rank all-reduces the counts (a batch without labels counts none: its model returns no loss)
        counted = [self._labels_counted(batch).to(device) for batch in batches]
        return loss_weights(counted, world_size, device).unbind()

    def _label_count(self, batch) -> torch.Tensor:
        """How many labels of `batch` its loss is the mean over (ignored ones left out)."""
        return (self._labels_counted(batch) != IGNORE).sum()

    def _labels_counted(self, batch) -> torch.Tensor:
        """The labels of `batch` its loss is the mean over (none where it has no labels)."""
        assert self.counted_labels is not None
        if not isinstance(batch, dict) or not isinstance(batch.get("labels"), torch.Tensor):
            return torch.empty(0)
        return self.counted_labels(batch)

    def _loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if in_training(model) in self._checked_in:
            return self._compute(model, batch)
        try:
            loss, parts = self._compute(model, batch)
        except Exception as e:
            if not rejected_input(e):
                raise
            raise DistsetupError(*self._rejected(batch, e, in_training(model)), alike_on_every_rank=True) from e
        if not self._counts_no_label(batch):  # its mean over no labels is nan, whatever the loss function
            self._check(loss, parts, in_training(model))
            self._checked_in.add(in_training(model))
        return loss, parts

    def _counts_no_label(self, batch) -> bool:
        """Whether the loss is the mean over the batch's labels and every one is ignored (an SFT sample cut before
        its completion): it weighs nothing (`weighted`)."""
        return self.counted_labels is not None and self._label_count(batch).item() == 0

    def _compute(self, model: nn.Module, batch) -> tuple[Any, dict[str, Any]]:
        """The micro-batch's loss and the terms logged beside it, as returned (_check checks them at the first step):
        training.loss's other entries where it returns a dict (`{"loss": ce + kl, "ce": ce, "kl": kl}`), else the
        model's aux_loss, if any."""
        if self.loss is not None:
            returned = self.loss(model, batch)
            if isinstance(returned, dict) and not hasattr(returned, "to_tuple"):  # its own terms (not a ModelOutput)
                if "loss" not in returned:
                    keys = ", ".join(map(str, returned))
                    raise DistsetupError(
                        f"{self.loss_source} returned a dict without 'loss' (its keys: {keys}).",
                        "put the micro-batch's mean loss, the one backward takes, under 'loss'; the other entries are "
                        "logged beside it.",
                        alike_on_every_rank=True,
                    )
                loss = returned["loss"]
                return loss, {name: _as_float_term(part, loss) for name, part in returned.items() if name != "loss"}
            return _loss_and_aux(returned)
        if isinstance(batch, dict):
            outputs = model(**batch, **self.forward_kwargs)
        else:
            outputs = model(*batch) if isinstance(batch, list | tuple) else model(batch)
        return _loss_and_aux(outputs)

    def _rejected(self, batch, error: Exception, training: bool) -> tuple[str, str]:
        what = user_code.what_raised(error)
        first = "the first batch" if training else "the first validation batch"
        if self.loss is not None:
            return (
                f"{self.loss_source} raised {what} on {first}, {described_batch(batch)}.",
                mixed_dtypes_fix(error, self.weights_cast) or f"fix {self.loss_source}.",
            )
        call = (
            "model(**batch)"
            if isinstance(batch, dict)
            else "model(*batch)"
            if isinstance(batch, list | tuple)
            else "model(batch)"
        )
        return (
            f"{self.model_source}'s model rejected {first}, {described_batch(batch)}, called as {call}: {what}.",
            mixed_dtypes_fix(error, self.weights_cast)
            or "make data.builder's samples what its forward takes, or compute the loss in training.loss (a bug inside "
            "the forward shows here too: run it on one batch by hand for the traceback).",
        )

    def _check(self, loss, parts: dict, training: bool) -> None:
        source = self.loss_source or f"{self.model_source}'s model"
        fix = (
            "return the micro-batch's mean loss (a tensor of one number, e.g. F.mse_loss(...)), or a dict with it as "
            "'loss' and other terms to log beside it."
            if self.loss_source
            else "return the micro-batch's mean loss (a tensor of one number), or an object with it as .loss."
        )
        for name, value in {"loss": loss, **parts}.items():
            if not is_scalar_loss(value):
                what = (
                    f"a {value.dtype} tensor of shape {list(value.shape)}"
                    if isinstance(value, torch.Tensor)
                    else f"a {type(value).__name__}"
                )
                term = "the loss" if name == "loss" else f"its term {name!r}"
                raise DistsetupError(
                    f"{source} returned {what} as {term}, not a floating-point scalar tensor.",
                    fix,
                    alike_on_every_rank=True,
                )
        if taken := sorted(set(parts) & LOGGED_BESIDE_THE_LOSS):
            raise DistsetupError(
                f"{source} returned a term named {taken[0]!r}, a name the log line has for its own figure.",
                f"name it otherwise (the log's own: {', '.join(sorted(LOGGED_BESIDE_THE_LOSS))}).",
                alike_on_every_rank=True,
            )
        if training and not torch.isfinite(loss).item():  # evaluation's: said beside the step's
            by_hand = "check the loss on one batch by hand (a log of 0, a division by 0, inputs of NaN)."
            if self.resumed_from is None:
                raise DistsetupError(f"{source} returned a loss of {loss.item()} at the first step.", by_hand)
            raise DistsetupError(
                f"{source} returned a loss of {loss.item()} at the first step after resuming from "
                f"{self.resumed_from}: its weights, or the loss function, give no number.",
                f"where {source} is as it was, move that checkpoint aside to resume from the one before it; else "
                f"{by_hand}",
            )


# What each log line has besides the loss's terms (Trainer._log), and an evaluation's (evaluation.evaluate), which
# run_record tells apart by its val_loss
LOGGED_BESIDE_THE_LOSS = {
    "step",
    "lr",
    "samples_per_s",
    "tokens_per_s",
    "mfu",
    "loss_scale",
    "val_loss",
    "val_perplexity",
}


def _loss_and_aux(outputs) -> tuple[Any, dict[str, Any]]:
    """`.loss` (or `outputs` itself) and `.aux_loss`, if any, of what a model or a loss returned."""
    aux = field_of(outputs, "aux_loss", None)
    return field_of(outputs, "loss", outputs), {} if aux is None else {"aux_loss": aux}


def _as_float_term(term: Any, loss: Any) -> Any:
    """A term training.loss returned as a number of another kind, made a floating-point one beside the loss: a Python
    or NumPy number (a KL of 0.0 where evaluation computes none), an integer or boolean tensor of one element (a count
    of correct answers); anything else as it is (the first call's check says what is wrong with it)."""
    if not isinstance(loss, torch.Tensor):
        return term
    if isinstance(term, numbers.Real) and not isinstance(term, bool):
        return loss.new_tensor(float(term), dtype=torch.float32)
    if isinstance(term, torch.Tensor) and term.numel() == 1 and not term.is_floating_point() and not term.is_complex():
        return term.float()
    return term

"""What a micro-batch's loss is: the one interface between the trainer and every model and data kind.

- Token data (synthetic, files, chat, ...): the batch is (input ids, target ids), the model's forward(input_ids)
  returns the logits [B, T, vocab] (or an object or dict holding `logits`, and an `aux_loss` to add), and the loss is
  the mean cross-entropy over the counted targets. For a large vocabulary the built-in GPT's and a Hugging Face
  model's output head computes it a slice of the vocabulary at a time instead (sliced.py, training.chunked_loss):
  the logits never exist whole. A Hugging Face model is called as transformers trains it (no KV
  cache) and an MoE one with its router logits: its load-balancing loss is added as transformers adds it,
  `router_aux_loss_coef` x `aux_loss`; a python model's `aux_loss` is added as it is (weighted inside the model).
- The user's own data (data.type python): training.loss(model, batch), or else model(**batch) (a dict) or
  model(*batch) (a list or tuple), whose result is the loss or holds it as `.loss` (the Hugging Face convention).

The first call checks what the user's code returned, in one line naming the setting to fix.
"""

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import RunConfig
from distsetup.training import user_code
from distsetup.training.data.datasets import IGNORE, Datasets, loss_weights
from distsetup.training.loss.counted_labels import labels_averaged
from distsetup.training.loss.first_step_errors import described_batch, mixed_dtypes_fix, rejected_input
from distsetup.training.loss.model_outputs import field_of, forward_kwargs, terms_left_out
from distsetup.training.loss.output_heads import loss_head
from distsetup.training.loss.sliced import LossHead, targets_for


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
        checking = check and _training(model) not in self._checked_in
        try:
            outputs = model(x, **self.forward_kwargs)
        except Exception as e:
            if not (checking and rejected_input(e)):
                raise
            what = user_code.what_raised(e)
            raise DistsetupError(
                f"{self.source}'s model rejected the first {'' if _training(model) else 'validation '}batch of token "
                f"data, input ids of shape {list(x.shape)}, "
                f"called as model(input_ids): {what}.",
                mixed_dtypes_fix(e, self.weights_cast)
                or "make its forward take the input ids first (forward(input_ids) -> logits), or compute the loss in "
                "training.loss.",
                alike_on_every_rank=True,
            ) from e
        logits, aux = field_of(outputs, "logits", outputs), field_of(outputs, "aux_loss", None)
        if checking:
            self._check(logits, aux if _training(model) else None, x)  # evaluation adds no aux_loss
            if _training(model) and (left_out := terms_left_out(outputs)):
                self.say(
                    f"note: {self.source}'s model returned {', '.join(left_out)} beside its logits: the next-token "
                    "loss leaves it out (it adds aux_loss only); return it as aux_loss, weighted inside the model, or "
                    "compute the loss in training.loss"
                )
            self._checked_in.add(_training(model))
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
        if _training(model) in self._checked_in:
            return self._compute(model, batch)
        try:
            loss, parts = self._compute(model, batch)
        except Exception as e:
            if not rejected_input(e):
                raise
            raise DistsetupError(*self._rejected(batch, e, _training(model)), alike_on_every_rank=True) from e
        if not self._counts_no_label(batch):  # its mean over no labels is nan, whatever the loss function
            self._check(loss, parts, _training(model))
            self._checked_in.add(_training(model))
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


def objective_for(
    module: nn.Module, cfg: RunConfig, data: Datasets, loss_function: Callable | None, probe: nn.Module | None = None
) -> tuple["TokenObjective | PythonObjective", str]:
    """The objective a run trains `module` by, and a note on how its loss is computed (or ""): token data's
    next-token loss from the model's logits (sliced where training.chunked_loss says), else the model's own loss or
    training.loss on the user's batches. `probe`: see loss_head."""
    m, t = cfg.model, cfg.training
    source = f"model.builder {m.builder}" if m.type == "python" else f"model.type {m.type}"
    if data.tokens and loss_function is None:  # token data: its train set says whether targets are masked
        head, note = loss_head(module, m, t.chunked_loss, probe)
        return TokenObjective(module, m.type, m.vocab_size, data.train.masked, source, head), note
    loss_source = t.loss and f"training.loss {t.loss}"
    counted = labels_averaged(module) if loss_function is None else None
    return PythonObjective(loss_function, loss_source, source, forward_kwargs(module, m.type), counted), ""


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


def _training(model: Any) -> bool:
    """The mode a call runs in (a callable that is no module, as some tests pass: training)."""
    return bool(getattr(model, "training", True))

"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in backward."""

import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import RunConfig
from distsetup.training.backends.base import Backend
from distsetup.training.backends.rank0_buffers import buffers_may_change
from distsetup.training.loss.micro_loss import MicroLoss
from distsetup.training.model import moe
from distsetup.training.model.build import Description, ModelParts

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel


class ModelValuesThrough(torch.nn.parallel.DistributedDataParallel):
    """DDP that gives a training.loss the model's parameters and values it reads (model.annotator_logit, a Crowd-BT
    scorer's), as FSDP2 (the model itself) and DeepSpeed's engine give them; the model's methods and modules are
    not, since a call that is not DDP's forward would leave DDP's gradient bookkeeping behind (its error says so)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            value = getattr(self.module, name)
        if callable(value) and not isinstance(value, torch.Tensor):  # an AttributeError still: hasattr() is False
            raise AttributeError(
                f"DDP's wrapper gives model.{name} ({type(value).__name__}) of the model it wraps to no caller: only "
                f"the model's forward, model(...), keeps DDP's gradients in step (compute it there, or call "
                f"model.module.{name} where no gradient flows)"
            )
        return value


def check_unused_parameters_setting(cfg: RunConfig, description: Description) -> None:
    """distributed.find_unused_parameters false beside layers that run other experts on each rank: DDP would wait for
    gradients that never come. Refused before the process group, and in --check."""
    if cfg.distributed.find_unused_parameters is False and description.conditional:
        raise DistsetupError(
            f"distributed.find_unused_parameters false with {description.conditional}, which may run other "
            "experts on each rank: DDP would wait for the gradients of experts a rank did not run.",
            "leave distributed.find_unused_parameters unset (or the HF Trainer's ddp_find_unused_parameters out).",
        )


class DDPBackend(Backend):
    """DistributedDataParallel: gradients all-reduced in backward, skipped with no_sync() while accumulating."""

    name = "ddp"
    finds_unused = False  # whether DDP looks for parameters without a gradient (_place)

    def _handle_conditional(self, layers: list[nn.Module]) -> None:
        """DDP looks for the experts a rank did not run; one that no rank ran gets a zero gradient, as under FSDP2
        and ZeRO."""
        if layers:
            self.notes.append(
                f"{moe.described_layers(layers)} may run other experts on each rank: DDP looks for unused parameters "
                "(find_unused_parameters). Where a step's tokens reach every expert, torch warns once per rank that "
                "it found none: that step needed no search, others will"
            )
        self.unrouted_as_zero = layers

    def check_model(self, description: Description) -> None:
        check_unused_parameters_setting(self.cfg, description)

    def _place(self, model: nn.Module, parts: ModelParts) -> nn.Module:
        DDP = ModelValuesThrough

        ids = [self.device.index] if self.device.type == "cuda" else None
        options: dict[str, Any] = buffer_sync(DDP, buffers_may_change(model, self.cfg.model.type))
        if "init_sync" in inspect.signature(DDP).parameters:  # torch 2.4 on
            options["init_sync"] = False  # every copy holds rank 0's values already (_whole_on_device)
        unused = self.cfg.distributed.find_unused_parameters  # not false beside experts: check_model
        self.finds_unused = bool(parts.conditional) if unused is None else unused
        # gradient_as_bucket_view: .grad aliases the all-reduce buckets, so gradients are held once.
        return DDP(
            model,
            device_ids=ids,
            gradient_as_bucket_view=True,
            find_unused_parameters=self.finds_unused,
            **options,
        )

    def _forward(self, loss_of: Callable[[nn.Module], MicroLoss]) -> MicroLoss:
        try:
            return super()._forward(loss_of)
        except RuntimeError as e:
            if (said := unused_parameters(e, self.finds_unused)) is not None:
                raise said from e
            raise

    def _plain_model(self) -> nn.Module:
        return cast("DistributedDataParallel", self.model).module

    def _sync(self, last_micro: bool) -> contextlib.AbstractContextManager:
        ddp = cast("DistributedDataParallel", self.model)
        return contextlib.nullcontext() if last_micro else ddp.no_sync()


def unused_parameters(error: RuntimeError, looking: bool) -> DistsetupError | None:
    """The one line for DDP's refusal of a step whose synchronised backward left parameters without a gradient
    (torch's "Expected to have finished reduction in the prior iteration", raised at the next forward on each rank
    whose reducer still waits); None for any other error. `looking`: DDP looks for unused parameters already, and
    then an output of the forward that the loss does not take is the cause (torch's own words say so)."""
    if "Expected to have finished reduction in the prior iteration" not in str(error):
        return None
    if looking:
        return DistsetupError(
            "DDP: parameters of the model got no gradient in a step's synchronised backward, though DDP looks for "
            "unused ones: an output of the model's forward does not go into the loss.",
            "compute the loss from every output the forward returns (or return only those it takes).",
            alike_on_every_rank=True,
        )
    return DistsetupError(
        "DDP: parameters of the model got no gradient in a step's synchronised backward (a layer it runs on some "
        "micro-batches or some ranks only), and DDP waits for each one's.",
        "set distributed.find_unused_parameters: true (DDP then looks for them each step: slower), or run that layer "
        "on every micro-batch; FSDP2 and DeepSpeed need no setting.",
        alike_on_every_rank=True,
    )


def buffer_sync(ddp_class: type, before_each_forward: bool) -> dict:
    """DDP's argument for broadcasting buffers before each forward: forward_sync_buffers from torch 2.13 (which
    warns about broadcast_buffers, deprecated there), broadcast_buffers before it."""
    if "forward_sync_buffers" in inspect.signature(ddp_class).parameters:
        return {"forward_sync_buffers": before_each_forward}
    return {"broadcast_buffers": before_each_forward}

"""FSDP2 units handing on their outputs as tensors that are no views (output_not_a_view): the root (a user's model
ending in `squeeze(-1)`), the blocks (a Hugging Face Switch Transformer's layer returns one) and the fp32 norm units
(an InstanceNorm's output is a view), so that FSDP2's pre-backward hook on them survives an in-place op and FSDP2 does
not warn of each view."""

import dataclasses
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.utils import _apply_to_tensors


class _NotAView(torch.autograd.Function):
    """`tensor` itself, no copy (its storage and version counter), as a tensor autograd does not count as a view: the
    hooks registered on it then survive an in-place op on it, as on any other tensor. Gradients pass unchanged."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def output_not_a_view(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """A forward hook on a unit, run before FSDP2's: each view among the unit's outputs (a user's model ending in
    `squeeze(-1)`, an LLM's logits from a 3-D Linear) handed on as a tensor that is no view, at no memory cost.

    FSDP2 registers its pre-backward hook (which gathers the unit's parameters, and at the root queues the end of
    backward) on each output tensor, and warns of every view there: an in-place op on a view replaces the view's
    autograd node, and the hook with it. On a tensor that is no view, an in-place op keeps the hook (torch's rule for
    non-views); the version counter is the view's own, so a value that backward needs and the op overwrote is still
    an error, as without FSDP2. Left as they are (FSDP2 still warns): views whose base another output or an input also
    reaches, since autograd would then no longer see that they share values."""
    if not torch.is_grad_enabled():
        return None
    outputs = _tensors(output)
    views = [t for t in outputs if t.requires_grad and t._base is not None]
    if not views:
        return None
    reached = [id(t if t._base is None else t._base) for t in [*outputs, *_tensors((args, kwargs))]]
    alone = {id(view) for view in views if reached.count(id(view._base)) == 1}
    return _apply_to_tensors(lambda t: _NotAView.apply(t) if id(t) in alone else t, output) if alone else None


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in `tree`, in the containers torch's _apply_to_tensors goes into (FSDP2 casts outputs with it)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        items = [getattr(tree, field.name) for field in dataclasses.fields(tree)]
    elif isinstance(tree, dict):
        items = list(tree.values())
    elif isinstance(tree, (list, tuple, set)):
        items = list(tree)
    else:
        return []
    return [tensor for item in items for tensor in _tensors(item)]

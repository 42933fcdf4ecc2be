"""Next-token cross-entropy computed a slice of the vocabulary at a time, so the fp32 logits [tokens, vocab] never
exist whole: forward keeps a running log-sum-exp per position, backward recomputes each slice's logits and writes
that slice's rows of the head's gradient once (no accumulation across slices: exact in the weight's dtype). The
extra memory is a slice's logits (1/16 of the whole for a large vocabulary) instead of the logits, their
log-softmax and their gradient (Liger-Kernel's fused linear cross-entropy and torchtitan's chunked loss have the
same aim; slicing the vocabulary rather than the positions reads the head's weight once per pass).

The model's output head (an nn.Linear: the built-in GPT's `lm_head`, a Hugging Face model's output embeddings)
becomes a LossHead: inside `targets_for(head, targets)` its forward returns the summed cross-entropy instead of the
logits. The head still runs as a module inside the model's own forward, so DDP, FSDP2 (the root unit holds it) and
ZeRO-3 (it is gathered by its own hooks) treat it as before; its parameters keep their names."""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsetup.planning.loss_slices import slice_width
from distsetup.training.data.datasets import IGNORE


def _slice_logits(hidden, weight, bias, start: int, stop: int) -> torch.Tensor:
    """The fp32 logits of ids start:stop, computed in `hidden`'s dtype (the head's matrix product's own)."""
    dtype = hidden.dtype
    part = None if bias is None else bias[start:stop].to(dtype)
    return F.linear(hidden, weight[start:stop].to(dtype), part).float()


def _in_slice(safe: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which targets `safe` [N] fall in the slice of ids start:start + width, and each one's column in it [N, 1]
    (clamped into the slice where it falls outside: a column to gather or scatter at, its value then unused). Masks,
    not the rows' indices: finding those (nonzero, boolean indexing) makes the host wait for the device."""
    inside = (safe >= start) & (safe < start + width)
    return inside, (safe - start).clamp(0, width - 1).unsqueeze(1)


def _subtract_targets(grad: torch.Tensor, safe: torch.Tensor, start: int) -> None:
    """grad [N, width], the softmax of the slice of ids start:start + width, minus the one-hot of the targets `safe`
    that fall in it, in place: 1 subtracted at each such target (x + -1.0 is x - 1.0 exactly), -0.0 added at a
    clamped column of the other rows (x + -0.0 is x)."""
    inside, column = _in_slice(safe, start, grad.shape[1])
    grad.scatter_add_(1, column, inside.unsqueeze(1).to(grad.dtype).neg())


class _SlicedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of hidden [N, d] @ weight[V, d].T (+ bias) against targets [N] (IGNORE: not
    counted), its matrix products in `dtype` in forward and backward alike (autocast's, which backward runs
    without)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, width: int, dtype: torch.dtype):
        ctx.width, ctx.dtype = width, dtype
        computed = hidden.to(dtype)
        counted = targets != IGNORE
        safe = torch.where(counted, targets, 0)
        lse = torch.full(targets.shape, -torch.inf, dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, weight.shape[0], width):
            logits = _slice_logits(computed, weight, bias, start, start + width)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
            inside, column = _in_slice(safe, start, logits.shape[1])
            target_logit += torch.where(inside, logits.gather(1, column).squeeze(1), 0.0)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        return ((lse - target_logit) * counted).sum()

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        computed = hidden.to(ctx.dtype)
        counted = targets != IGNORE
        safe = torch.where(counted, targets, 0)
        scale = (grad_output.float() * counted).unsqueeze(1)  # d loss / d logits = (softmax - one-hot) x scale
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        for start in range(0, weight.shape[0], ctx.width):
            grad = _slice_logits(computed, weight, bias, start, start + ctx.width)
            stop = start + grad.shape[1]
            grad.sub_(lse.unsqueeze(1)).exp_()  # the softmax, in place
            _subtract_targets(grad, safe, start)
            grad.mul_(scale)
            if grad_hidden is not None:
                grad_hidden += grad.to(ctx.dtype) @ weight[start:stop].to(ctx.dtype)
            if grad_weight is not None:
                grad_weight[start:stop] = grad.t().to(ctx.dtype) @ computed
            if grad_bias is not None:
                grad_bias[start:stop] = grad.sum(0)
        grad_hidden = grad_hidden.to(hidden.dtype) if grad_hidden is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def sliced_cross_entropy(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of `head`(hidden [..., d]) against targets [...], never holding the whole logits."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    width = slice_width(head.weight.shape[0])
    device = flat.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else flat.dtype
    return _SlicedCrossEntropy.apply(flat, head.weight, head.bias, targets.reshape(-1), width, dtype)


class LossHead(nn.Linear):
    """An output head that, given targets (`targets_for`), returns their summed cross-entropy instead of logits."""

    targets: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        return sliced_cross_entropy(hidden, self, self.targets)


@contextlib.contextmanager
def targets_for(head: LossHead, targets: torch.Tensor):
    """Within: `head` returns the summed cross-entropy against `targets`."""
    head.targets = targets
    try:
        yield
    finally:
        head.targets = None


def as_loss_head(head: nn.Linear) -> LossHead:
    """`head`, a plain nn.Linear, turned into a LossHead in place (its parameters and their names as they are)."""
    head.__class__ = LossHead
    return head  # type: ignore[return-value]

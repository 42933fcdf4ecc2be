"""The sliced cross-entropy (training/loss/sliced.py) on the device: the same loss and gradients as the plain one over
the whole logits, in fp32 and under bf16 autocast, and a fraction of its peak device memory."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE

from distsetup.training.data.datasets import IGNORE
from distsetup.training.loss.sliced import sliced_cross_entropy

# tokens x width -> vocabulary: on a GPU the logits are 1 GiB in fp32 (the plain loss holds about 3 such tensors)
SHAPE = {"cuda": (8192, 1024, 32768), "cpu": (256, 64, 8192)}[DEVICE]


def losses_and_grads(loss_of, hidden, head, targets, autocast: bool):
    """(loss, d loss / d hidden, d loss / d head.weight, peak device bytes while computing them)."""
    hidden = hidden.detach().requires_grad_()
    head.zero_grad(set_to_none=True)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of(hidden, head, targets)
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if DEVICE == "cuda" else None
    return loss.detach().float(), hidden.grad.float(), head.weight.grad.float(), peak


def plain(hidden, head, targets):
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_sliced_loss_equals_the_plain_one_on_the_device(autocast, record):
    tokens, width, vocab = SHAPE
    generator = torch.Generator(DEVICE).manual_seed(0)
    hidden = torch.randn(tokens, width, device=DEVICE, generator=generator)
    head = nn.Linear(width, vocab, bias=False, device=DEVICE)
    targets = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=generator)
    targets[::7] = IGNORE  # masked positions, as instruction data has
    sliced = losses_and_grads(sliced_cross_entropy, hidden, head, targets, autocast)
    whole = losses_and_grads(plain, hidden, head, targets, autocast)
    tolerance = {"rtol": 2e-2, "atol": 1e-3} if autocast else {"rtol": 1e-4, "atol": 1e-5}
    for mine, reference in zip(sliced[:3], whole[:3], strict=True):
        torch.testing.assert_close(mine, reference, **tolerance)
    if DEVICE == "cuda":
        assert sliced[3] < whole[3] / 2, (sliced[3], whole[3])
    record(shape=list(SHAPE), sliced_peak_bytes=sliced[3], plain_peak_bytes=whole[3], loss=float(whole[0]))

"""The speed features on the CPU, in one process: selective activation checkpointing recomputes no matmul yet gives
the same gradients, and training.activation_checkpointing still reads its old boolean spelling. (torch.compile's
runs: tests/processes/test_compiled_runs.py.)"""

import pytest
import torch

from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.model.blocks import apply_activation_checkpointing
from distsetup.training.model.gpt import GPT


def gradients_and_backward_flops(mode: str) -> tuple[list[torch.Tensor], int]:
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = GPT(256, 32, 2, 2, 64, 0.0)
    if mode != "none":
        apply_activation_checkpointing(model, list(model.blocks), mode)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    loss = model(x, x)
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return [p.grad for p in model.parameters()], flops.get_total_flops()


def test_selective_checkpointing_recomputes_no_matmul_and_changes_no_gradient():
    plain, plain_flops = gradients_and_backward_flops("none")
    full, full_flops = gradients_and_backward_flops("full")
    selective, selective_flops = gradients_and_backward_flops("selective")
    assert full_flops > plain_flops == selective_flops  # full checkpointing runs each block's matmuls again
    for a, b, c in zip(plain, full, selective, strict=True):
        assert torch.allclose(a, b, atol=1e-7) and torch.allclose(a, c, atol=1e-7)


@pytest.mark.parametrize("written, read", [(True, "full"), (False, "none"), ("selective", "selective")])
def test_activation_checkpointing_reads_its_old_boolean_spelling(written, read):
    cfg = load_run_config(None, [f"training.activation_checkpointing={str(written).lower()}"])
    assert cfg.training.activation_checkpointing == read

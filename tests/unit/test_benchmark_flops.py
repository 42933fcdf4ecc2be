"""benchmarks/gpu_throughput.py's arithmetic, without running it: its parameter count is the built-in model's,
and its FLOPs per token six times the multiplied parameters plus attention's (the MFU column rests on both)."""

import sys

from repo import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_throughput import flops_per_token, parameters  # noqa: E402

SMALL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "micro_batch_size": 2}


def test_parameter_count_is_the_models():
    from types import SimpleNamespace

    from distsetup.training.model.gpt import GPT

    a = SimpleNamespace(**SMALL)
    model = GPT(256, a.block_size, a.n_layer, a.n_head, a.n_embd, 0.0)
    assert parameters(a) == sum(p.numel() for p in model.parameters())
    lookups = model.wte.weight.numel() + model.wpe.weight.numel()
    assert flops_per_token(a) == 6 * (parameters(a) - lookups) + 12 * a.n_layer * a.n_embd * a.block_size

"""The Switch example's model with a routing that differs per rank by construction: rank r sends its tokens to
experts 2r and 2r + 1 alone, so in every step the ranks run different experts (and some run on no rank). A model
builder for run configs (model.builder: moe_per_rank:build_model, with tests/support/ and the example on PYTHONPATH)."""

import torch
import torch.distributed as dist
from switch import SwitchFFN
from switch import build_model as build_switch


class PerRankSwitchFFN(SwitchFFN):
    def routed_to(self, expert: int, choice: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = torch.arange(len(choice), device=choice.device) % 2 + 2 * rank
        return (mine == expert).nonzero().squeeze(-1)


def build_model(**args):
    model = build_switch(**args)
    for block in model.blocks:
        block.moe.__class__ = PerRankSwitchFFN
    return model

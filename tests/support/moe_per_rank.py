"""Mixtures of experts whose routing differs per rank by construction, as model builders for run configs (with
tests/support/ and examples/switch_moe on PYTHONPATH):

- moe_per_rank:build_model, the Switch example's model: rank r sends its tokens to experts 2r and 2r + 1 alone, so in
  every step the ranks run different experts (and some run on no rank);
- moe_per_rank:build_hf_switch, a tiny transformers SwitchTransformersForConditionalGeneration built from its config
  (nothing downloaded) whose routers send rank r's tokens to expert r alone, after transformers' own router has run
  (its jitter noise multiplies the router's input in place in training); with moe_per_rank:build_copy_data, samples
  {input_ids, labels} for the model's own loss.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from switch import SwitchFFN
from switch import build_model as build_switch


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class PerRankSwitchFFN(SwitchFFN):
    def routed_to(self, expert: int, choice: torch.Tensor) -> torch.Tensor:
        mine = torch.arange(len(choice), device=choice.device) % 2 + 2 * rank()
        return (mine == expert).nonzero().squeeze(-1)


def build_model(**args):
    model = build_switch(**args)
    for block in model.blocks:
        block.moe.__class__ = PerRankSwitchFFN
    return model


def build_hf_switch(vocab_size: int = 64, d_model: int = 16, experts: int = 2):
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersTop1Router

    class PerRankTop1Router(SwitchTransformersTop1Router):
        def forward(self, hidden_states):
            dispatch, probs, logits = super().forward(hidden_states)  # jitters hidden_states in place
            mine = torch.full(dispatch.shape[:-1], rank() % self.num_experts, device=dispatch.device)
            return F.one_hot(mine, self.num_experts).to(dispatch.dtype), probs, logits

    config = SwitchTransformersConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_heads=2,
        num_layers=1,
        num_decoder_layers=1,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        num_experts=experts,
        router_jitter_noise=0.01,  # transformers' default, kept explicit: it is what changes the input in place
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    model = SwitchTransformersForConditionalGeneration(config)
    for module in model.modules():
        if isinstance(module, SwitchTransformersTop1Router):
            module.__class__ = PerRankTop1Router
    return model


class CopyTask(torch.utils.data.Dataset):
    """Sequences of ids 1 .. vocab_size - 1 whose labels are themselves (the decoder learns to copy)."""

    def __init__(self, samples: int, length: int, vocab_size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab_size, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def build_copy_data(split: str, samples: int = 256, length: int = 8, vocab_size: int = 64):
    return CopyTask(samples, length, vocab_size, seed=0 if split == "train" else 1)

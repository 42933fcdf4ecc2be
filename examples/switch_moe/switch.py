"""A Switch Transformer of your own (Fedus et al. 2021): a causal LM whose feed-forward layers are mixtures of experts
with top-1 routing, a capacity factor and the load-balancing loss, written as a user writes one. Its experts live in
an nn.ModuleList and run only when tokens are routed to them, so in one step two ranks may run different experts:
distsetup finds such layers by itself and tells each backend (DDP, FSDP2, ZeRO 1-3) what it needs.

With distsetup's token data, forward(input_ids) returns {"logits": [B, T, vocab], "aux_loss": ...}; the trainer adds
aux_loss (already weighted by aux_loss_coef here) to the cross-entropy and logs both.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SwitchFFN(nn.Module):
    """Each token goes to its router's most probable expert, scaled by that probability. An expert takes at most
    capacity_factor x tokens / experts tokens; the ones over its capacity are dropped (they pass on through the
    residual). The load-balancing loss, experts x sum_i f_i P_i (f_i: the fraction of tokens routed to expert i, P_i:
    its mean router probability), is lowest when the experts share the tokens evenly; it is kept in `aux_loss`."""

    def __init__(self, width: int, experts: int, capacity_factor: float):
        super().__init__()
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        top_prob, choice = probs.max(dim=-1)
        count = len(self.experts)
        capacity = max(1, int(self.capacity_factor * len(tokens) / count))
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            routed = self.routed_to(e, choice)[:capacity]
            if len(routed):  # an expert no token reached does not run: its parameters get no gradient here
                out[routed] = expert(tokens[routed]) * top_prob[routed, None].to(tokens.dtype)
        fraction = F.one_hot(choice, count).float().mean(dim=0)
        self.aux_loss = count * (fraction * probs.mean(dim=0)).sum()
        return out.reshape(x.shape)

    def routed_to(self, expert: int, choice: torch.Tensor) -> torch.Tensor:
        """The indices of the tokens routed to `expert`, in order."""
        return (choice == expert).nonzero().squeeze(-1)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, experts: int, capacity_factor: float):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.moe = SwitchFFN(width, experts, capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.norm1(x)).chunk(3, -1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.moe(self.norm2(x))


class SwitchLM(nn.Module):
    def __init__(self, vocab_size, block_size, width, layers, heads, experts, capacity_factor, aux_loss_coef):
        super().__init__()
        self.aux_loss_coef = aux_loss_coef
        self.tokens, self.positions = nn.Embedding(vocab_size, width), nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads, experts, capacity_factor) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        aux_loss = sum(block.moe.aux_loss for block in self.blocks) / len(self.blocks)
        return {"logits": self.head(self.norm(x)), "aux_loss": self.aux_loss_coef * aux_loss}


def build_model(
    vocab_size: int = 256,
    block_size: int = 64,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
    experts: int = 8,
    capacity_factor: float = 1.25,
    aux_loss_coef: float = 0.01,
) -> SwitchLM:
    return SwitchLM(vocab_size, block_size, width, layers, heads, experts, capacity_factor, aux_loss_coef)

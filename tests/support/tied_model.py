"""A user's own language model with what sharding from rank 0 must keep (tests/processes/test_fsdp_from_rank0.py):
an output head tied to the embedding by attribute, a non-persistent buffer the forward checks, and a persistent one;
with `shared_mask`, a non-persistent buffer that every block holds, which each block checks.
Its builder notes, in the file BUILT_LOG names, on which device each rank built it, and before each training forward
how many parameters ZeRO-3 holds gathered; with `checkpoint_ballast_mib`, each
state_dict() (a checkpoint's) touches that much memory for a moment, which no training peak may count."""

import functools
import os
import sys

import torch
import torch.nn as nn

POSITIONS = 64


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        if hasattr(self, "mask") and not torch.equal(self.mask, causal_mask()):
            raise RuntimeError("the non-persistent buffer `mask` that every block shares was not restored")
        return x + torch.tanh(self.mix(self.norm(x)))


def causal_mask() -> torch.Tensor:
    return torch.ones(POSITIONS, POSITIONS, dtype=torch.bool).tril()


class TiedLM(nn.Module):
    def __init__(
        self, vocab: int, width: int, layers: int, odd_buffers: bool = False, wider: bool = False, shared_mask=False
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 and many Hugging Face models do
        self.register_buffer("positions", self.expected_positions(), persistent=False)  # in no state dict
        self.register_buffer("scale", torch.full((1,), 0.5))
        if odd_buffers:  # a float64 buffer (as numpy makes one), and one buffer that two modules hold
            self.register_buffer("steps", torch.arange(4, dtype=torch.float64))
            self.blocks[0].register_buffer("shared", self.scale)
        if shared_mask:  # one non-persistent buffer that every block holds, as a model shares its causal mask
            mask = causal_mask()
            for block in self.blocks:
                block.register_buffer("mask", mask, persistent=False)
        if wider:  # another shape than the other ranks build
            self.extra = nn.Linear(2, 3)

    @staticmethod
    def expected_positions(device=None) -> torch.Tensor:
        return torch.arange(POSITIONS, device=device, dtype=torch.float32) / POSITIONS

    def forward(self, idx):
        if not torch.equal(self.positions, self.expected_positions(idx.device)):
            raise RuntimeError("the non-persistent buffer `positions` was not restored")
        x = self.embed(idx) * self.scale + self.positions[: idx.shape[1], None]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(
    vocab: int = 64,
    width: int = 16,
    layers: int = 2,
    odd_buffers: bool = False,
    wider_on_rank: int = -1,
    checkpoint_ballast_mib: int = 0,
    shared_mask: bool = False,
) -> TiedLM:
    if log := os.environ.get("BUILT_LOG"):
        with open(log, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {where_built()}\n")
    wider = os.environ.get("RANK", "0") == str(wider_on_rank)
    model = TiedLM(vocab, width, layers, odd_buffers, wider, shared_mask)
    if log:
        model.register_forward_pre_hook(functools.partial(log_gathered_parameters, log=log))
    if checkpoint_ballast_mib:
        model.register_state_dict_pre_hook(functools.partial(touch_memory, mib=checkpoint_ballast_mib))
    return model


def log_gathered_parameters(model: nn.Module, _, log: str) -> None:
    """Before each training forward: "gathered <rank> <n>", the parameters ZeRO-3 holds whole (persistent ones
    aside)."""
    if model.training:
        gathered = [p for p in model.parameters() if getattr(p, "ds_status", None) is not None]
        gathered = [p for p in gathered if p.ds_status.name == "AVAILABLE" and not p.ds_persist]
        with open(log, "a") as f:
            f.write(f"gathered {os.environ.get('RANK', '0')} {len(gathered)}\n")


def touch_memory(*_, mib: int) -> None:
    torch.ones(mib, 2**18).sum()  # mib MiB of float32, resident until freed at once


def where_built() -> str:
    """meta, cpu, or partitioned (inside DeepSpeed's zero.Init: each parameter partitioned as it is created)."""
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return "partitioned" if zero is not None and zero.zero_init_context else torch.get_default_device().type

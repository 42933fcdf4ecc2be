"""The model shapes the planner counts: ModelShape, the analytic count of a GPT, the published shapes that stand in
for a model given by its size alone, distsetup's built-in sizes, and a Hugging Face config.json read without torch or
transformers."""

import math
from dataclasses import dataclass
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats.reading import read_json
from distsetup.formats.runconfig import BUILTIN_BLOCK
from distsetup.formats.runconfig_rules import hf_positions, no_causal_lm

GELU_MLP_UNITS = 19.0  # GPT's MLP (h -> 4h, GeLU, 4h -> h) in ModelShape.mlp_activation_units


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model; hidden/layers/vocab only matter for activations."""

    params: int
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    block_params: int | None = None  # the largest transformer block; default 12h^2 + 13h
    blocks_params: int | None = None  # all blocks together, where they differ (a mixture of experts' dense layers)
    largest_module_params: int | None = None  # largest module's own parameters
    layer_cls: str = BUILTIN_BLOCK
    # what a layer's MLP keeps for backward per token, in 16-bit values per hidden unit x 2 (Korthikanti et al.'s
    # unit), the mean over layers: GPT's GeLU MLP of 4h keeps 19; a gated MLP more, a mixture of experts each expert
    # a token is routed to (gated_mlp_units)
    mlp_activation_units: float = GELU_MLP_UNITS

    @property
    def block(self) -> int:
        if self.block_params is not None:
            return self.block_params
        if self.hidden_size:
            return 12 * self.hidden_size**2 + 13 * self.hidden_size
        return self.params // max(self.num_layers or 1, 1)

    @property
    def root(self) -> int:
        """Parameters outside the blocks (embeddings, final norm, head): FSDP's root unit."""
        if not self.num_layers:
            return 0
        blocks = self.blocks_params if self.blocks_params is not None else self.block * self.num_layers
        return max(self.params - blocks, 0)

    @property
    def largest_module(self) -> int:
        if self.largest_module_params is not None:
            return self.largest_module_params
        if self.hidden_size:
            return max(mlp_in_params(self.hidden_size), (self.vocab_size or 0) * self.hidden_size)
        return self.block

    @property
    def zero3_unit(self) -> int:
        """The most parameters ZeRO-3 gathers at once: a block, which the trainer makes a leaf gathered whole, or
        where the model has no blocks known (no layers), its largest module."""
        return max(self.largest_module, self.block) if self.num_layers else self.largest_module


def gated_mlp_units(h: int, intermediate: int) -> float:
    """A gated MLP's (gate, up, down: Llama's) saved activations per token in ModelShape.mlp_activation_units: its
    input, the gate's and the up projection's outputs, the activation's and the product's (h + 4 x intermediate
    values)."""
    return 2 * (h + 4 * intermediate) / h


def block_params(h: int) -> int:
    """A GPT-2 style block of hidden size h: qkv, proj, fc and fc-proj weights and biases, two LayerNorms."""
    return 12 * h * h + 13 * h


def mlp_in_params(h: int) -> int:
    """Its MLP's first layer (h -> 4h, with bias): the block's largest module."""
    return 4 * h * h + 4 * h


def gpt_params(vocab_size: int, block_size: int, n_layer: int, n_embd: int, tied: bool = False) -> int:
    """Parameters of a GPT-2 style model with biases and learned positions (analytic count)."""
    h = n_embd
    head = 0 if tied else vocab_size * h
    return n_layer * block_params(h) + vocab_size * h + block_size * h + 2 * h + head


def gpt_shape(vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, layer_cls: str) -> ModelShape:
    """The built-in GPT's shape, counted without torch: its largest module is its MLP's first layer, the token
    embedding or the position embedding."""
    h = n_embd
    return ModelShape(
        params=gpt_params(vocab_size, block_size, n_layer, n_embd),
        hidden_size=h,
        num_layers=n_layer,
        num_heads=n_head,
        vocab_size=vocab_size,
        block_params=block_params(h),
        largest_module_params=max(mlp_in_params(h), vocab_size * h, block_size * h),
        layer_cls=layer_cls,
    )


# Published decoder shapes (GPT-3 paper Table 2.1; Llama 2 for 7B-70B): params, hidden, layers, heads, vocab.
KNOWN_SHAPES = [
    (125e6, 768, 12, 12, 50257),
    (350e6, 1024, 24, 16, 50257),
    (760e6, 1536, 24, 16, 50257),
    (1.3e9, 2048, 24, 16, 50257),
    (2.7e9, 2560, 32, 32, 50257),
    (6.7e9, 4096, 32, 32, 32000),
    (13e9, 5120, 40, 40, 32000),
    (33e9, 6656, 60, 52, 32000),
    (70e9, 8192, 80, 64, 32000),
    (175e9, 12288, 96, 96, 50257),
]


def assumed_shape(params: int) -> tuple[int, int, int, int]:
    """(hidden, layers, heads, vocab) of the published model nearest in size: a stand-in for activations."""
    return min(KNOWN_SHAPES, key=lambda shape: abs(math.log(shape[0] / params)))[1:]


BYTE_VOCAB = 256  # the trainer's byte-level tokens


@dataclass(frozen=True)
class BuiltinSize:
    """A size of the built-in GPT: GPT-2's shapes (and nanoGPT's small one) with a byte vocabulary."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int

    def shape(self) -> ModelShape:
        return ModelShape(
            params=gpt_params(BYTE_VOCAB, self.block_size, self.n_layer, self.n_embd),
            hidden_size=self.n_embd,
            num_layers=self.n_layer,
            num_heads=self.n_head,
            vocab_size=BYTE_VOCAB,
            layer_cls=BUILTIN_BLOCK,
        )


BUILTIN_SIZES = {
    "tiny": BuiltinSize(2, 4, 64, 64),  # config/config.yaml's demo model
    "small": BuiltinSize(6, 6, 384, 256),  # nanoGPT's shakespeare_char
    "base": BuiltinSize(12, 12, 768, 1024),  # GPT-2 124M's shape
    "medium": BuiltinSize(24, 16, 1024, 1024),
    "large": BuiltinSize(36, 20, 1280, 1024),
    "xl": BuiltinSize(48, 25, 1600, 1024),
}


# A mixture of experts' expert count, by the name each family's config gives it (Mixtral and Qwen3-MoE; Qwen2-MoE and
# OLMoE; DeepSeek)
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def hf_shape_from_json(path: Path, layer_cls: str | None) -> ModelShape:
    """A Llama/GPT-style decoder's parameters from its config.json, without torch or transformers, a mixture of
    experts' experts included."""
    c = read_json(path)
    if said := no_causal_lm(c, str(path.parent)):
        raise DistsetupError(*said)
    try:
        h, v = int(c["hidden_size"]), int(c["vocab_size"])
        blocks = decoder_blocks(c)
        heads = _attention_heads(c)
        mlp_units = decoder_mlp_units(c)
        mean_mlp_units = sum(mlp_units) / max(len(mlp_units), 1)
    except (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
        raise DistsetupError(
            f"{path} does not describe a decoder ({type(e).__name__}: {e}).",
            "give a folder with a transformers config.json (model.hf_path, distsetup init --model).",
        )
    embeddings = v * h * (1 if c.get("tie_word_embeddings", False) else 2)
    names = c.get("architectures")
    first = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else "Model"
    arch = first.replace("ForCausalLM", "DecoderLayer")
    return ModelShape(
        params=sum(blocks) + embeddings + h,
        hidden_size=h,
        num_layers=len(blocks),
        num_heads=heads,
        vocab_size=v,
        block_params=max(blocks, default=0),  # the largest: what FSDP and ZeRO-3 gather at once
        blocks_params=sum(blocks),
        layer_cls=layer_cls or arch,
        mlp_activation_units=mean_mlp_units,
    )


def decoder_blocks(c: dict) -> list[int]:
    """Each decoder layer's parameters, from a config.json's keys: its attention, its MLP or (in a mixture of
    experts' sparse layers) its experts, their router and any shared expert, and its two norms."""
    h, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = _attention_heads(c)
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or h // heads)
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim  # q and o, k and v
    if c.get("attention_bias") or c.get("qkv_bias"):  # Llama's attention_bias: q, k, v and o; Qwen2's: q, k, v
        attention += heads * head_dim + 2 * kv * head_dim + (h if c.get("attention_bias") else 0)
    matrices = 2 if c.get("model_type") in UNGATED_MLP else 3  # (gate,) up, down
    dense = matrices * h * int(c.get("intermediate_size", 4 * h))
    experts = next((int(c[key]) for key in EXPERT_COUNTS if c.get(key)), 0)
    if not experts:
        return [attention + dense + 2 * h] * n
    expert = 3 * h * int(c.get("moe_intermediate_size") or c.get("intermediate_size", 4 * h))
    shared = 3 * h * int(c.get("shared_expert_intermediate_size") or 0)
    shared += h if shared else 0  # Qwen2-MoE's gate on its shared expert
    shared += int(c.get("n_shared_experts") or 0) * expert  # DeepSeek's
    mixture = experts * expert + h * experts + shared  # the router: hidden x experts
    return [attention + (mixture if _sparse(c, i) else dense) + 2 * h for i in range(n)]


def decoder_mlp_units(c: dict) -> list[int | float]:
    """Each decoder layer's MLP activations per token (ModelShape.mlp_activation_units), from a config.json's keys:
    a gated MLP (an ungated one in the families of UNGATED_MLP), or in a mixture of experts' sparse layers one per
    expert each token is routed to (num_experts_per_tok) and its shared expert."""
    h, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
    width = int(c.get("intermediate_size", 4 * h))
    if c.get("model_type") in UNGATED_MLP:
        return [2 * (h + 2 * width) / h + 1] * n  # its input, the up projection's and the activation's outputs, a mask
    experts = next((int(c[key]) for key in EXPERT_COUNTS if c.get(key)), 0)
    if not experts:
        return [gated_mlp_units(h, width)] * n
    expert_width = int(c.get("moe_intermediate_size") or width)  # as decoder_blocks counts its parameters
    routed = int(c.get("num_experts_per_tok") or 1) * gated_mlp_units(h, expert_width)
    shared_width = (
        int(c.get("shared_expert_intermediate_size") or 0) + int(c.get("n_shared_experts") or 0) * expert_width
    )
    shared = gated_mlp_units(h, shared_width) if shared_width else 0.0
    return [routed + shared if _sparse(c, i) else gated_mlp_units(h, width) for i in range(n)]


# Decoder families whose MLP has no gate (up, activation, down): GPT-NeoX (Pythia), Phi-1/2, StarCoder2, Falcon,
# GPT-J, CodeGen, OPT, BLOOM, GPT-BigCode
UNGATED_MLP = frozenset({"gpt_neox", "phi", "starcoder2", "falcon", "gptj", "codegen", "opt", "bloom", "gpt_bigcode"})


def _attention_heads(c: dict) -> int:
    """A config.json's attention heads; where it does not say, one per 128 of its hidden size (Llama's head size)."""
    return int(c.get("num_attention_heads", max(1, int(c["hidden_size"]) // 128)))


def _sparse(c: dict, i: int) -> bool:
    """Whether a mixture of experts' layer `i` holds experts, by the keys each family spaces them with: Qwen's every
    decoder_sparse_step-th layer but its mlp_only_layers, Llama 4's every interleave_moe_layer_step-th, DeepSeek's
    every moe_layer_freq-th from first_k_dense_replace on."""
    every = int(c.get("decoder_sparse_step") or c.get("interleave_moe_layer_step") or 1)
    after_dense = i - int(c.get("first_k_dense_replace") or 0)
    return (
        (i + 1) % every == 0
        and i not in (c.get("mlp_only_layers") or ())
        and after_dense >= 0
        and i % int(c.get("moe_layer_freq") or 1) == 0
    )


def hf_context_length(path: Path) -> int | None:
    """The longest sequence a Hugging Face config.json allows, if it says (runconfig_rules.hf_positions)."""
    found = hf_positions(read_json(path))
    return found[1] if found else None

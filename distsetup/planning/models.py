"""The model shapes the planner counts: distsetup's built-in sizes, and a Hugging Face config.json read
without torch or transformers."""

from dataclasses import dataclass
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats.reading import read_json
from distsetup.planning.planner import ModelShape, gpt_params

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
            layer_cls="Block",
        )


BUILTIN_SIZES = {
    "tiny": BuiltinSize(2, 4, 64, 64),  # config/config.yaml's demo model
    "small": BuiltinSize(6, 6, 384, 256),  # nanoGPT's shakespeare_char
    "base": BuiltinSize(12, 12, 768, 1024),  # GPT-2 124M's shape
    "medium": BuiltinSize(24, 16, 1024, 1024),
    "large": BuiltinSize(36, 20, 1280, 1024),
    "xl": BuiltinSize(48, 25, 1600, 1024),
}


def hf_shape_from_json(path: Path, layer_cls: str | None) -> ModelShape:
    """A Llama/GPT-style decoder's parameters from its config.json, without torch or transformers."""
    c = read_json(path)
    try:
        h, n, v = (int(c[key]) for key in ("hidden_size", "num_hidden_layers", "vocab_size"))
        heads = int(c.get("num_attention_heads", max(1, h // 128)))
        kv = int(c.get("num_key_value_heads", heads))
        inter = int(c.get("intermediate_size", 4 * h))
        block = 2 * h * h + 2 * h * (h // heads) * kv + 3 * h * inter + 2 * h
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
        params=n * block + embeddings + h,
        hidden_size=h,
        num_layers=n,
        num_heads=heads,
        vocab_size=v,
        block_params=block,
        layer_cls=layer_cls or arch,
    )


def hf_context_length(path: Path) -> int | None:
    """The longest sequence a Hugging Face config.json allows (max_position_embeddings), if it says."""
    value = read_json(path).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None

"""The models: a nanoGPT-style decoder (its block class is `Block`) and Hugging Face causal LMs."""

import functools
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsetup.errors import DistsetupError
from distsetup.planning.planner import gpt_params


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.fc, self.proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One transformer block: the unit that FSDP shards and activation checkpointing recomputes."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; forward(idx, targets) returns the mean next-token loss."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        # Untied from wte: a weight shared between the root and a block would be sharded twice.
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the GPT interface (the data already shifts targets by one)."""

    hf: Any  # the transformers PreTrainedModel (its config, _no_split_modules)

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, idx, targets=None):
        logits = self.hf(input_ids=idx).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def architecture_on_meta(m) -> "GPT | HFCausalLM":
    """The model a run config's model section `m` describes, built on the meta device: its parameters' names and
    shapes without memory or weights (an hf model from its config.json alone; nothing is read or downloaded)."""
    with torch.device("meta"):
        if m.type == "gpt":
            return GPT(m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.dropout)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(m.hf_path, local_files_only=True)
        return HFCausalLM(AutoModelForCausalLM.from_config(config))


def require_transformers() -> None:
    """Hugging Face models need transformers (and huggingface_hub, which it brings): the `hf` extra."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise DistsetupError("model type hf needs transformers.", "pip install 'distsetup[hf]'.") from None


def build_model(cfg) -> tuple["GPT | HFCausalLM", list[str]]:
    """The model from `cfg.model` and the names of its block classes (what to shard and checkpoint)."""
    m = cfg.model
    if m.type == "gpt":
        layers = [m.layer_cls] if m.layer_cls else ["Block"]
        return GPT(m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.dropout), layers
    require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(m.hf_path)
    if not (path / "config.json").exists():
        raise DistsetupError(
            f"model.hf_path {path} has no config.json.",
            "save one with e.g. LlamaConfig(...).save_pretrained(path); nothing is downloaded.",
        )
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    if has_weights:
        hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path, local_files_only=True), torch_dtype=torch.float32
        )
    if hf.config.vocab_size < m.vocab_size:
        raise DistsetupError(
            f"the hf model's vocab_size {hf.config.vocab_size} is below model.vocab_size {m.vocab_size}.",
            "raise it in config.json or lower model.vocab_size.",
        )
    layers = [m.layer_cls] if m.layer_cls else list(getattr(hf, "_no_split_modules", None) or [])
    if not layers:
        raise DistsetupError(f"{type(hf).__name__} names no layer class.", "set model.layer_cls.")
    return HFCausalLM(hf), layers


def embedding_rows(m) -> tuple[int, str]:
    """The rows of the embedding of the model section `m`'s model (the ids it can read) and where that is set."""
    if m.type == "gpt":
        return m.vocab_size, "model.vocab_size"
    require_transformers()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(m.hf_path, local_files_only=True).vocab_size, f"{m.hf_path}'s vocab_size"
    except (OSError, ValueError) as e:
        raise DistsetupError(f"model.hf_path {m.hf_path}: {e}.", "point it at a folder with a config.json.") from None


def check_model_fits(cfg, processes_per_node: int) -> None:
    """Every process of a node builds the whole model in CPU memory first (4 bytes a parameter): refuse, before
    any process group, a built-in GPT that cannot be built, rather than a traceback from the allocator or a
    visit from the OOM killer. (A Hugging Face model's size is known only once its config is read.)"""
    m = cfg.model
    if m.type != "gpt":
        return
    parameters = gpt_params(m.vocab_size, m.block_size, m.n_layer, m.n_embd)
    needed, available = 4 * parameters * processes_per_node, available_memory()
    if needed > available:
        raise DistsetupError(
            f"the model has {parameters:,} parameters: {processes_per_node} process(es) building it need "
            f"{needed / 2**30:,.1f} GiB, more than this machine's {available / 2**30:,.1f} GiB of free memory.",
            "lower model.n_embd, model.n_layer or model.vocab_size.",
        )


def available_memory() -> int:
    """Bytes the kernel could hand out now (MemAvailable counts reclaimable caches; free pages do not)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def layer_modules(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The model's blocks, found by class name; an unknown name is an error, not silent no-sharding."""
    names = {n.strip() for n in class_names if n.strip()}
    found = [mod for mod in model.modules() if type(mod).__name__ in names]
    if not found:
        raise DistsetupError(
            f"no module of class {', '.join(sorted(names))} in {type(model).__name__}.",
            "fix fsdp_transformer_layer_cls_to_wrap or model.layer_cls.",
        )
    return found


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module], mode: str = "full") -> None:
    """Recompute each block's activations in backward instead of storing them: all of them (`full`), or all but
    the outputs of its matmuls and attention (`selective`: PyTorch's selective activation checkpointing; what
    is recomputed is cheap elementwise work, and backward runs no matmul twice)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as apply
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapper = checkpoint_wrapper
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        wrapper = functools.partial(
            checkpoint_wrapper, context_fn=lambda: create_selective_checkpoint_contexts(_keep_expensive_outputs)
        )
    ids = {id(b) for b in blocks}
    apply(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda mod: id(mod) in ids)


def in_place_of(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules standing where `blocks` were: their activation-checkpointing wrappers, or the blocks."""
    wrappers = {id(getattr(m, "_checkpoint_wrapped_module", None)): m for m in model.modules()}
    return [wrappers.get(id(b), b) for b in blocks]


def compile_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """torch.compile each block (with its activation checkpointing) in place, as torchtitan does before sharding:
    parameter names and the state dict stay as they were, and FSDP2 and ZeRO-3 keep their hooks between blocks."""
    for unit in in_place_of(model, blocks):
        unit.compile()


def _keep_expensive_outputs(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _expensive_ops() else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _expensive_ops() -> frozenset:
    """Matmuls and attention kernels (those this build of torch has)."""
    names = [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ]
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))

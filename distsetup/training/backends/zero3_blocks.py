"""ZeRO-3 block by block: each of the model's blocks a leaf module, which DeepSpeed gathers whole in one all-gather
and whose gradients it reduces together when the block's backward ends, as FSDP2 does its units, instead of hooking
each layer inside it (benchmarks/zero3_leaves.py: a step of peers.py's small Llama about 3.5% quicker on a CPU, the
same losses).

DeepSpeed reduces a leaf's gradients in a full backward hook (register_full_backward_hook, stage3.py's
reduce_leaf_module_grads), which is right only for a block that runs once a step on a positional input that needs
its gradient: for one whose inputs need none the hook fires before the block's own gradients exist, and for one run
twice a step (a loss calling the model twice, a block shared) it fires twice. So the trainer does it only where it
knows both: the built-in GPT and Hugging Face causal LMs under its own loss, each block with parameters of its own
(and checks the input at each forward, in case a Hugging Face model names another class among its blocks). Not with
NVMe parameter offload, whose swapper takes at most `buffer_count` (5) parameters at a time, fewer than a block's.
Not where the DeepSpeed file chooses leaves itself."""

from collections import Counter

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.formats.deepspeed import offload_device
from distsetup.formats.runconfig import RunConfig
from distsetup.training.model.blocks import in_place_of, outermost

# The keys of a file's zero_optimization block by which DeepSpeed chooses ZeRO-3's leaf modules (gathered whole)
FILE_CHOOSES_LEAVES = ("stage3_module_granularity_threshold", "leaf_module")
LAYER_BY_LAYER_HINT = (
    "set zero_optimization.stage3_module_granularity_threshold to 0 in the DeepSpeed file (ZeRO-3 then gathers layer "
    "by layer)"
)


def gathered_whole(cfg: RunConfig, ds_config: dict, model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules standing where the model's outermost blocks are, to be made leaves, each given a check of its
    input at every forward; [] where this run keeps DeepSpeed's hooks layer by layer (the module's docstring)."""
    zero = ds_config.get("zero_optimization") or {}
    if (
        not blocks
        or set(FILE_CHOOSES_LEAVES) & set(zero)
        or cfg.model.type == "python"
        or cfg.training.loss is not None
        or offload_device(ds_config, "offload_param") == "nvme"
        or not _parameters_of_their_own(model, blocks)
    ):
        return []
    units = in_place_of(model, outermost(blocks))
    for unit in units:
        unit.register_forward_pre_hook(_refuse_an_input_needing_no_gradient)
    return units


def made_leaves(whole_blocks: tuple[nn.Module, ...], conditional: list[nn.Module]) -> tuple[nn.Module, ...]:
    """Marks ZeRO-3's leaf modules for DeepSpeed and returns them: the blocks gathered whole, and each layer that may
    run other experts per rank (gathered whole, or ranks would wait on each other's gathers) that none of the blocks
    holds (one inside a block is gathered with it: DeepSpeed would never read its mark)."""
    from deepspeed.utils import set_z3_leaf_module

    in_blocks = {id(module) for block in whole_blocks for module in block.modules()}
    leaves = (*whole_blocks, *(layer for layer in conditional if id(layer) not in in_blocks))
    for leaf in leaves:
        set_z3_leaf_module(leaf, True)
    return leaves


def _parameters_of_their_own(model: nn.Module, blocks: list[nn.Module]) -> bool:
    """Whether each of the blocks' parameters is reached once in the model (no block or weight of theirs shared), so
    that its block's backward is the only one giving it a gradient. (The tied embedding and head are no block's.)"""
    reached = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return all(reached[id(p)] == 1 for block in blocks for p in block.parameters())


def _refuse_an_input_needing_no_gradient(block: nn.Module, args: tuple) -> None:
    if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        name = type(getattr(block, "_checkpoint_wrapped_module", block)).__name__
        raise DistsetupError(
            f"DeepSpeed ZeRO-3 gathers each block whole, and block {name} takes no positional input that needs a "
            "gradient, where DeepSpeed's leaf hook would reduce its gradients before they exist.",
            f"{LAYER_BY_LAYER_HINT}, or name the blocks of the residual stream in model.layer_classes.",
            alike_on_every_rank=True,
        )

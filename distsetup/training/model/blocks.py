"""The model's repeated blocks (model.layer_classes): found by class name, and what is done to each of them before
any sharding (activation checkpointing, then torch.compile)."""

import functools
from typing import cast

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.formats.problems import closest
from distsetup.training.model.running_statistics import keeps_running_statistics


def layer_modules(model: nn.Module, class_names: list[str], setting: str = "model.layer_classes") -> list[nn.Module]:
    """The model's blocks, found by class name; a name that finds nothing is an error naming `setting` (where the
    names come from), not silent no-sharding."""
    names = {n.strip() for n in class_names if n.strip()}
    if type(model).__name__ in names:  # FSDP2 would shard it twice, checkpointing would skip it silently
        raise DistsetupError(
            f"{setting}: {type(model).__name__} is the whole model, not one of its blocks.",
            f"name the class of its repeated blocks in {setting} (e.g. {_block_class_example(model)}).",
            alike_on_every_rank=True,  # the same model and names on every rank: said once
        )
    found = [mod for mod in model.modules() if type(mod).__name__ in names]
    missing = names - {type(mod).__name__ for mod in found}
    if missing:
        raise DistsetupError(
            f"{setting}: no module of class {', '.join(sorted(missing))} in {type(model).__name__}.",
            near_class(model, missing)
            or f"name classes of the model's own blocks in {setting} (e.g. {_block_class_example(model)}).",
            alike_on_every_rank=True,
        )
    return found


def near_class(model: nn.Module, names) -> str:
    """'did you mean X?' where a name is a typo of a class of the model's modules (in any case: LlamaMlp), else ''."""
    classes = {type(module).__name__ for module in model.modules()}
    near = [close for name in sorted(names) if (close := closest(name, classes)) is not None]
    return f"did you mean {', '.join(near)}?" if near else ""


def _block_class_example(model: nn.Module) -> str:
    """The class of the model's first container child, as an example of a block class it has."""
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module):
            return type(module[0]).__name__
    return type(model).__name__


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
    ids = {id(b) for b in outermost(blocks)}
    apply(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda mod: id(mod) in ids)
    for unit in in_place_of(model, outermost(blocks)):
        _statistics_updated_once(unit)


def _statistics_updated_once(wrapper: nn.Module) -> None:
    """Running statistics (BatchNorm's) inside a checkpointed block updated by its forward only: backward's recompute
    runs the block again in training mode, which would update them a second time each step. The recompute calls the
    block inside `wrapper`, not `wrapper` itself, so a forward of its own is one between the wrapper's hooks."""
    norms = [m for m in wrapper.modules() if keeps_running_statistics(m)]
    if not norms:
        return
    spares = [_Spares(norm) for norm in norms]
    in_forward = [False]

    def forward_starts(module: nn.Module, args: tuple) -> None:
        in_forward[0] = True
        for spare in spares:  # made here, outside the checkpointed region: its recompute may run no op of its own
            spare.made_like_the_buffers()

    wrapper.register_forward_pre_hook(forward_starts)
    wrapper.register_forward_hook(lambda module, args, output: in_forward.__setitem__(0, False), always_call=True)
    for spare in spares:
        spare.norm.register_forward_pre_hook(lambda module, args, spare=spare: spare.swap_in(not in_forward[0]))
        spare.norm.register_forward_hook(lambda module, args, output, spare=spare: spare.swap_back(), always_call=True)


class _Spares:
    """Buffers `norm` updates in the recompute in place of its own, which stay as the forward left them. A swap of
    objects and no tensor op: selective checkpointing's recompute must run the ops of the forward, in its order."""

    def __init__(self, norm: nn.Module):
        self.norm = norm
        self.spare: dict[str, torch.Tensor] = {}
        self.own: dict[str, torch.Tensor] = {}

    def made_like_the_buffers(self) -> None:
        for name, buffer in self.norm.named_buffers(recurse=False):
            spare = self.spare.get(name)
            if spare is None or (spare.shape, spare.dtype, spare.device) != (buffer.shape, buffer.dtype, buffer.device):
                self.spare[name] = torch.empty_like(buffer)

    def swap_in(self, recomputing: bool) -> None:
        if recomputing and self.norm.training and self.spare:
            for name, spare in self.spare.items():
                self.own[name] = cast(torch.Tensor, self.norm._buffers[name])
                self.norm._buffers[name] = spare

    def swap_back(self) -> None:
        if not self.own:  # the forward's (no mutation for torch.compile to trace)
            return
        for name, own in self.own.items():
            self.norm._buffers[name] = own
        self.own.clear()


def recompute_mismatch(error: BaseException) -> DistsetupError | None:
    """The one line for selective checkpointing's refusal of a recompute that runs other operations than its block's
    forward did (torch's "... encountered during backward but not found in storage"): under ZeRO-3 a model run twice
    a step finds a block gathered in one and not in the other. None for any other error."""
    if not (isinstance(error, RuntimeError) and "encountered during backward but not found in storage" in str(error)):
        return None
    return DistsetupError(
        "training.activation_checkpointing selective: backward's recompute of a block ran other operations than its "
        f"forward ({str(error).split(' encountered')[0]}; under ZeRO-3, a model run twice a step finds its blocks' "
        "weights gathered in one and not in the other).",
        "set training.activation_checkpointing: full, which recomputes whatever the block runs.",
        alike_on_every_rank=True,
    )


def outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks inside no other block (model.layer_classes may name a layer and a part of it): checkpointing the
    outer one recomputes the inner one's activations already, and checkpointing both would run the inner forward a
    third time in backward; compiling the outer one compiles the inner one."""
    inside = {id(inner) for block in blocks for inner in block.modules() if inner is not block}
    return [block for block in blocks if id(block) not in inside]


def in_place_of(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules standing where `blocks` were: their activation-checkpointing wrappers, or the blocks."""
    wrappers = {id(getattr(m, "_checkpoint_wrapped_module", None)): m for m in model.modules()}
    return [wrappers.get(id(b), b) for b in blocks]


def compile_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """torch.compile each block (with its activation checkpointing) in place, as torchtitan does before sharding:
    parameter names and the state dict stay as they were, and FSDP2 and ZeRO-3 keep their hooks between blocks."""
    for unit in in_place_of(model, outermost(blocks)):
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


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)  # what activation checkpointing adds to parameter names


def plain_name(name: str) -> str:
    """A parameter's name without what wrappers (activation checkpointing) add to it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name

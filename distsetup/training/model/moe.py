"""Layers that run differently on each rank: a mixture of experts whose experts (an nn.ModuleList or nn.ModuleDict of
modules alike) run only when tokens are routed to them, so that in one step two ranks may run different experts.

Each backend must then be told, or its collectives go wrong: DDP waits for gradients that never come unless it
looks for unused parameters; FSDP2 and DeepSpeed ZeRO 1-2 reduce whatever gradients each rank has, which no longer
line up between ranks (silently mixing them: measured here, ZeRO-2 and FSDP2 trained other numbers than DDP);
ZeRO-3 gathers a module's parameters in its forward, so ranks gathering different experts wait for each other
forever (deepspeedai/DeepSpeed#4808) unless the layer is one "leaf" gathered whole.

That layer is the innermost module that holds the experts and picks which of them run: their container where it has a
forward of its own (transformers' SwitchTransformersExperts, an nn.ModuleDict), else the module around a plain
nn.ModuleList or nn.ModuleDict. Never a layer further out: DeepSpeed's leaf hooks the leaf's input and output, and the
code around the experts may change its input in place (the Switch router's jitter noise, `hidden_states *= ...`),
which the hook refuses ("Output 0 of BackwardHookFunction is a view and is being modified inplace"). (Where ZeRO-3
gathers each block whole, backends/zero3_blocks.py, a layer inside a block is gathered with it and is no leaf itself.)
"""

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.training.memory import full_shape
from distsetup.training.model.blocks import near_class


def expert_container(module: nn.Module) -> nn.ModuleList | nn.ModuleDict | None:
    """The child of `module` holding its experts: an nn.ModuleList or nn.ModuleDict of two or more modules of one
    class with parameters of the same shapes, each more than one torch.nn layer (a list of nn.Linear is a model's
    heads more often than its experts)."""
    for child in module.children():
        if not isinstance(child, (nn.ModuleList, nn.ModuleDict)) or len(child) < 2:
            continue
        members = list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
        shapes = {(type(m), tuple(tuple(full_shape(p)) for p in m.parameters())) for m in members}
        single_layers = torch_class(type(members[0])) and not any(True for _ in members[0].children())
        if len(shapes) == 1 and not single_layers and any(True for _ in members[0].parameters()):
            return child
    return None


def torch_class(cls: type) -> bool:
    """Whether `cls` is one of torch.nn's own modules (Linear, Conv2d, Sequential, ...), not the user's."""
    return cls.__module__.startswith("torch.nn.")


def conditional_layers(model: nn.Module, block_classes: set[str], leaf_classes: list[str]) -> list[nn.Module]:
    """The layers of `model` that may run differently on each rank: those holding experts (expert_container; the
    model's list of blocks is no experts, but experts named among the blocks, model.layer_classes, are: a router
    picks among them), each the innermost that picks which experts run (runs_itself: the container, else the
    module around it), and those of model.zero3_leaf_classes, outermost first, none inside another, never the model
    itself (gathered whole by ZeRO-3, it would not be sharded at all)."""
    named = set(leaf_classes)
    found: list[nn.Module] = []
    for module in model.modules():
        if module is not model and type(module).__name__ in named:
            found.append(module)
        container = expert_container(module)
        if container is None:
            continue
        if type(next(iter(container.children()))).__name__ in block_classes and not routed(module, container):
            continue  # the model's own list of blocks (experts named among the blocks have a router beside them)
        layer = container if runs_itself(container) else module
        if layer is not model and not any(layer is seen for seen in found):
            found.append(layer)
    missing = named - {type(m).__name__ for m in found}
    if missing:
        raise DistsetupError(
            f"model.zero3_leaf_classes: no module of class {', '.join(sorted(missing))} in {type(model).__name__}.",
            near_class(model, missing)
            or "name the class of the model's MoE layer (the module that routes tokens to its experts).",
            alike_on_every_rank=True,
        )
    inner = {id(sub) for layer in found for sub in layer.modules() if sub is not layer}
    return [layer for layer in found if id(layer) not in inner]


def routed(holder: nn.Module, container: nn.ModuleList | nn.ModuleDict) -> bool:
    """Whether a router sits beside `container` in the module holding it: an nn.Linear (outside the container) with an
    output per member, the scores a mixture of experts picks its experts by. A model's list of blocks has none."""
    inside = {id(module) for module in container.modules()}
    return any(
        isinstance(module, nn.Linear) and module.out_features == len(container) and id(module) not in inside
        for module in holder.modules()
    )


def runs_itself(container: nn.Module) -> bool:
    """Whether an expert container has a forward of its own (a plain nn.ModuleList or nn.ModuleDict has none: the
    module around it calls the experts)."""
    return type(container).forward is not nn.Module.forward


def leaf_hook_refused(error: BaseException) -> bool:
    """Whether `error` is DeepSpeed's ZeRO-3 leaf hook refusing an in-place change of the leaf's input or output
    (torch's BackwardHookFunction, behind register_full_backward_hook): the model's layer, not the data."""
    text = str(error)
    return isinstance(error, RuntimeError) and "of BackwardHookFunction is a view and is being modified inplace" in text


def leaf_hook_problem(leaves: list[nn.Module], way_out: str | None = None) -> tuple[str, str]:
    """The one-line error (and its hint) for leaf_hook_refused, naming the ZeRO-3 leaf layers (a block, not its
    activation-checkpointing wrapper); `way_out`: the hint's first way, where not naming another leaf class."""
    leaves = [getattr(layer, "_checkpoint_wrapped_module", layer) for layer in leaves]
    classes = ", ".join(sorted({type(layer).__name__ for layer in leaves}))
    instead = way_out or (
        f"name in model.zero3_leaf_classes the innermost module whose forward calls the experts instead of {classes}"
    )
    return (
        f"DeepSpeed ZeRO-3 cannot hook its leaf layer {described_layers(leaves)}: code inside or around it changes the "
        "layer's input or output in place (BackwardHookFunction: a view modified inplace), whatever the data.",
        f"{instead}, or change that tensor out of place (x = x * ...).",
    )


def refuse_deepspeed_moe(model: nn.Module) -> None:
    """DeepSpeed's own MoE layer (deepspeed.moe, expert parallelism) needs its engine's expert groups, optimizer groups
    and checkpoint files, which distsetup's trainer does not make: refused in one line, before any process group,
    rather than a hang at the engine's start (ranks broadcasting in different groups)."""
    found = [module for module in model.modules() if type(module).__module__.startswith("deepspeed.moe.")]
    layers = [layer for layer in found if not inside(layer, found)]
    if layers:
        raise DistsetupError(
            f"{type(model).__name__} holds DeepSpeed's own MoE layer ({described_layers(layers)}, "
            f"{type(layers[0]).__module__}), whose expert parallelism distsetup's trainer does not set up.",
            "write the experts as an nn.ModuleList or nn.ModuleDict picked by a router of your own "
            "(examples/switch_moe): distsetup finds such layers and trains them under every backend.",
            alike_on_every_rank=True,
        )


def described_layers(layers: list[nn.Module]) -> str:
    """'SwitchFFN (x4)': the classes of `layers`, counted (the user's: FSDP2 makes a sharded layer's class a
    subclass, FSDPSwitchFFN)."""
    counts: dict[str, int] = {}
    for layer in layers:
        name = _class_before_fsdp(type(layer)).__name__
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} (x{count})" for name, count in counts.items())


def _class_before_fsdp(cls: type) -> type:
    """The class fully_shard made `cls` from (it names its subclass FSDP<name>), else `cls`."""
    made_from = cls.__bases__[-1]
    return made_from if cls.__name__ == f"FSDP{made_from.__name__}" else cls


def inside(module: nn.Module, layers: list[nn.Module]) -> bool:
    """Whether `module` is part of one of `layers` (but not the layer itself)."""
    return any(module is not layer and any(module is sub for sub in layer.modules()) for layer in layers)


def zero_gradient_where_none(layers: list[nn.Module]) -> None:
    """A zero gradient for each trained parameter of `layers` that has none (an expert no rank ran in this step),
    as FSDP2 and ZeRO give it one: AdamW then steps such an expert alike under every backend (by its moments, and
    its weight decay), where it would pass over one without a gradient under one process and DDP alone. The
    parameters are looked up each time: placing the model may have made them anew (a rank that built a skeleton)."""
    for parameter in (p for layer in layers for p in layer.parameters() if p.requires_grad):
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)


def give_every_expert_a_gradient(layers: list[nn.Module]) -> None:
    """Make every expert parameter of `layers` take part in every forward, with weight 0: a pre-forward hook adds
    0 x one element of each to the layer's input. Every rank then gets a gradient (zeros for an expert it did not
    run) for every parameter, at one place in backward (the input's, reached after all the layer's experts), so
    that backends reducing gradients as they become ready (DeepSpeed ZeRO 1-2) reduce the same ones in the same
    order on every rank. It reads one element per parameter: no weight is read whole."""
    for layer in layers:
        layer.register_forward_pre_hook(_touch_parameters)


def _touch_parameters(layer: nn.Module, args: tuple):
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not first.is_floating_point():
        raise DistsetupError(
            f"{type(layer).__name__}'s first input is no floating-point tensor, so distsetup cannot give its unused "
            "experts a zero gradient, which this backend needs on every rank.",
            "set distributed.backend to ddp, or use a DeepSpeed file with zero_optimization.stage 3.",
        )
    touch = sum(p.view(-1)[0] for p in layer.parameters() if p.requires_grad and p.numel())
    return (first + touch * 0.0, *args[1:])

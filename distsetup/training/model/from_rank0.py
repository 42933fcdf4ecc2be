"""A model's values from rank 0's copy, so that only rank 0 ever builds them (and, sharded, no other rank ever holds
the model whole).

Rank 0 builds the model on the CPU (with the run's seed, or with pretrained weights); every other rank builds it on
the meta device. Sharded (FSDP2): each rank then moves its model to the meta device, shards it, allocates only its own
shards on its device (`to_empty`), and rank 0's tensors are broadcast into them one at a time
(torch.distributed.checkpoint's `broadcast_from_rank0`; Accelerate's cpu_ram_efficient_loading does the same with
broadcasts of its own). Whole on every rank (DDP, ZeRO 0-2): each rank allocates the model on its device, and rank 0's
tensors are broadcast into it (`replicate`). The initial weights are then those of a one-process run, bit for bit.

What a state dict leaves out is handled here too: `to_empty` leaves every buffer uninitialised, and non-persistent
buffers (rotary `inv_freq`, causal masks) are in no state dict, so every buffer is broadcast as well; and a weight
tied by attribute (an embedding shared with the output head) is one Parameter object, which moving to the meta device
would split in two, so the ties are made again.
"""

import itertools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.training.world import decided_by_rank0


@dataclass
class WholeValues:
    """Rank 0's model as it was built: its state dict and every buffer (persistent or not), on the CPU."""

    state: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


Ties = list[list[tuple[nn.Module, str]]]  # each: the (module, attribute) places of one shared Parameter


def whole_values(model: nn.Module, is_main: bool) -> WholeValues | None:
    """Rank 0's values, kept before the model goes to the meta device; None on the other ranks."""
    if not is_main:
        return None
    return WholeValues(dict(model.state_dict()), dict(model.named_buffers(remove_duplicate=False)))


def tied_parameters(model: nn.Module) -> Ties:
    """The Parameters that several modules hold (by attribute), each with every place it is held."""
    places: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                places[id(parameter)].append((module, name))
    return [held for held in places.values() if len(held) > 1]


def tie_again(ties: Ties) -> None:
    """Make each group of `ties` one Parameter again (the first place's)."""
    for (first_module, first_name), *others in ties:
        shared = first_module._parameters[first_name]
        for module, name in others:
            module._parameters[name] = shared


def to_meta(model: nn.Module) -> None:
    """The model's tensors to the meta device (its sharding allocates nothing whole), its ties kept."""
    ties = tied_parameters(model)
    model.to("meta")
    tie_again(ties)


def replicate(model: nn.Module, device: torch.device, is_main: bool) -> nn.Module:
    """Rank 0's model whole on every rank's `device`: rank 0's moved there, the others' (built on the meta device, or
    whole where their builder cannot build there) allocated there, their ties kept, and every parameter and buffer
    filled with rank 0's, one broadcast each: a collective."""
    ties = tied_parameters(model)
    if not is_main and any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
        model.to_empty(device=device)
    else:
        model.to(device)
    tie_again(ties)
    # by name, shared ones at each of their names: to_empty splits a buffer two modules hold, rank 0's stays one
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    check_built_alike(tensors)
    with torch.no_grad():
        for _, tensor in tensors:
            dist.broadcast(tensor, src=0)
    return model


def check_built_alike(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Every rank's tensors named, shaped and typed as rank 0's (a collective), else one line on every rank, naming
    the first rank that differs and how: a broadcast between tensors of other sizes would hang or fill garbage."""
    mine = [(name, str(t.dtype), tuple(t.shape)) for name, t in tensors]
    rank0 = decided_by_rank0(lambda: mine)
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, _difference(mine, rank0))
    problems = [f"rank {rank}: {difference}" for rank, difference in enumerate(found) if difference]
    if problems:
        raise DistsetupError(
            f"the ranks built the model differently ({problems[0]}).",
            "make model.builder build the same parameters and buffers (names, shapes, dtypes) on every rank, the "
            "meta device included.",
        )


def _difference(mine: list[tuple[str, str, tuple]], rank0: list[tuple[str, str, tuple]]) -> str:
    """How a rank's tensors (name, dtype, shape) differ from rank 0's; "" where they do not."""
    if mine == rank0:
        return ""
    ours, theirs = {name: rest for name, *rest in mine}, {name: rest for name, *rest in rank0}
    extra, missing = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    if extra or missing:
        return f"{extra[:3]} that rank 0 has not, rank 0's {missing[:3]} missing"
    name = next((name for name in ours if ours[name] != theirs[name]), None)
    if name is None:
        return "its tensors in another order"
    return f"{name} {ours[name][0]} {ours[name][1]}, rank 0's {theirs[name][0]} {theirs[name][1]}"


def fill_from_rank0(model: nn.Module, whole: WholeValues | None, buffers_on: torch.device) -> None:
    """Rank 0's values (`whole`; None elsewhere) into every rank's allocated shards, and its buffers, as they were
    built (their dtype), onto `buffers_on`: a collective. The shards and the persistent buffers must be on one device
    for set_model_state_dict (FSDP2's CPU offload: the CPU), which is why the buffers move only afterwards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    state: dict = whole.state if whole is not None else {}  # the others' values come from rank 0
    set_model_state_dict(model, state, options=options)
    broadcast_buffers(model, whole.buffers if whole is not None else {}, buffers_on, whole is not None)


def broadcast_buffers(model: nn.Module, built: dict[str, torch.Tensor], device: torch.device, is_main: bool) -> None:
    """Every buffer of `model` replaced by rank 0's (`built`: the model's buffers as built, by name; on the other ranks
    those of a copy on the meta device, or none), on `device`, in the dtype it was built in: a collective."""
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                reference = built.get(unwrapped(f"{prefix}.{name}" if prefix else name), buffer)
                value = reference.to(device) if is_main else torch.empty_like(reference, device=device)
                dist.broadcast(value, src=0)
                module._buffers[name] = value


WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing's and torch.compile's


def unwrapped(name: str) -> str:
    """A tensor's name in the model as built, before activation checkpointing or compile wrapped its blocks."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name

"""DeepSpeed ZeRO-0 in bf16 or fp16: the optimizer is DeepSpeed's wrapper around the run's own, holding fp32 master
weights beside the module's bf16/fp16 ones and, in fp16, the loss scale. Read by parameter name into a named state
(named_state.py), and loaded from one into a bf16 run's wrapper (ZeRO-0 fp16 files are refused: DeepSpeed 0.19 does
not loss-scale them, formats/deepspeed_rules.py).

The wrapper takes one of two forms (DeepSpeed 0.19's engine picks it by the inner optimizer):
- FP16_UnfusedOptimizer, around any torch optimizer (distsetup's AdamW): `fp32_groups`, a master tensor per
  parameter, and the inner optimizer's state numbered as torch numbers it;
- FP16_Optimizer, around DeepSpeed's FusedAdam (a DeepSpeed file's optimizer block): `fp32_groups_flat`, one flat
  master tensor per param group, and the inner state over those flat tensors.
Both keep the param groups that have parameters, in their order (training.optim.param_groups).
"""

import copy
import functools
import types
from typing import Any

import torch

from distsetup.training.checkpoint import loss_scale
from distsetup.training.checkpoint.streamed_io import Lazy, MappedTorchFile, item_at, storage_identity
from distsetup.training.checkpoint.zero_files import MOMENTS
from distsetup.training.model.blocks import plain_name
from distsetup.training.optim import decays, numbered

PER_PARAMETER, FLAT = "fp32_groups", "fp32_groups_flat"
FORMS = {False: "fp32 masters per parameter (a torch optimizer)", True: "flat fp32 masters (DeepSpeed's FusedAdam)"}
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def holds_wrapper(optimizer_state: Any) -> bool:
    """Whether a ZeRO-0 file's optimizer state is DeepSpeed's bf16/fp16 wrapper (else a torch optimizer's)."""
    return isinstance(optimizer_state, dict) and bool({PER_PARAMETER, FLAT} & optimizer_state.keys())


def lazy_named_state(mapped: MappedTorchFile, saved: dict, groups: list[list[str]] | None) -> dict:
    """{"model", "optimizer", "scaler"} of ZeRO-0 file `mapped` (its object listed: `saved`): the fp32 master weights
    by name (buffers and tied names as the module holds them), the inner optimizer keyed by names (None where
    `groups`, the loading run's names per param group, is None), the fp16 loss scale as GradScaler state."""
    module, wrapper = saved["module"], saved["optimizer"]
    names = [group for group in (groups or _param_names(saved)) if group]  # DeepSpeed drops empty groups
    flat = FLAT in wrapper
    _check_masters(wrapper, names, module)
    offset = {}
    for group in names:
        start = 0
        for name in group:
            offset[name], start = start, start + module[name].numel()
    number = {name: i for i, name in enumerate(name for group in names for name in group)}

    def values_of(name: str, where: tuple) -> Lazy:
        """Parameter `name`'s values in the tensor at `where`: all of it, or its piece of a flat group tensor."""
        shape, dtype = tuple(module[name].shape), item_at(saved, where).dtype
        if not flat:
            return Lazy(shape, dtype, functools.partial(mapped.read, where), identity=where)
        read = functools.partial(mapped.read, where, slice(offset[name], offset[name] + module[name].numel()))
        return Lazy(shape, dtype, lambda: read().view(shape), identity=(where, offset[name]))

    masters = {
        name: values_of(name, ("optimizer", FLAT, g) if flat else ("optimizer", PER_PARAMETER, g, i))
        for g, group in enumerate(names)
        for i, name in enumerate(group)
    }
    state = {"model": _with_buffers_and_ties(mapped, module, masters), "optimizer": None, "scaler": _scaler(wrapper)}
    if groups is None:
        return state
    inner = wrapper["optimizer_state_dict"]
    moments = {}
    for g, group in enumerate(names):
        for name in group:
            where = ("optimizer", "optimizer_state_dict", "state", g if flat else number[name])
            moments[name] = {
                key: values_of(name, (*where, key)) if key in MOMENTS else copy.deepcopy(value)
                for key, value in item_at(saved, where).items()
            }
    param_groups = [
        {**{k: copy.deepcopy(v) for k, v in settings.items() if k != "params"}, "params": group}
        for settings, group in zip(inner["param_groups"], names, strict=True)
    ]
    state["optimizer"] = {"state": moments, "param_groups": param_groups}
    return state


def load(wrapper, state: dict, groups: list[list[str]], settings: list[dict]) -> None:
    """Named state `state` (its weights already in the module) into a ZeRO-0 run's `wrapper`: the fp32 masters, and
    the inner optimizer's moments and steps with param group `settings`. `groups`: the run's parameter names per
    param group."""
    names = [group for group in groups if group]
    model, optimizer = state["model"], state["optimizer"]["state"]
    if hasattr(wrapper, FLAT):
        for master, group in zip(wrapper.fp32_groups_flat, names, strict=True):
            master.data.copy_(torch.cat([model[name].reshape(-1) for name in group]))
        inner = {
            "state": {
                g: {
                    **{k: v for k, v in optimizer[group[0]].items() if k not in MOMENTS},
                    **{key: torch.cat([optimizer[name][key].reshape(-1) for name in group]) for key in MOMENTS},
                }
                for g, group in enumerate(names)
            },
            "param_groups": [{**own, "params": [g]} for g, own in enumerate(settings)],
        }
    else:
        for masters, group in zip(wrapper.fp32_groups, names, strict=True):
            for master, name in zip(masters, group, strict=True):
                master.data.copy_(model[name])
        by_name = [{**own, "params": group} for own, group in zip(settings, names, strict=True)]
        inner = numbered({"state": optimizer, "param_groups": by_name})
    wrapper.optimizer.load_state_dict(inner)


def _check_masters(wrapper: dict, names: list[list[str]], module: dict) -> None:
    """Refuse parameter names that do not make up the wrapper's masters (a slice of a flat one would not say so)."""
    missing = [name for group in names for name in group if name not in module]
    if missing:
        raise ValueError(f"the checkpoint's module has no parameter {missing[0]}")
    saved: list
    made: list
    if FLAT in wrapper:
        saved = [tuple(master.shape) for master in wrapper[FLAT]]
        made = [(sum(module[name].numel() for name in group),) for group in names]
    else:
        saved = [[tuple(master.shape) for master in group] for group in wrapper[PER_PARAMETER]]
        made = [[tuple(module[name].shape) for name in group] for group in names]
    if saved != made:
        raise ValueError(f"DeepSpeed's fp32 masters are shaped {saved}, the model's parameters make {made}")


def _param_names(saved: dict) -> list[list[str]]:
    """The parameter names in each param group, from the module alone: its entries less buffers and the second name
    of a tied weight, in its order, split as training.optim.param_groups splits them."""
    # DeepSpeed names buffers with what wrappers add (activation checkpointing), the module's state dict without
    buffers, seen, params = {plain_name(name) for name in saved.get("buffer_names") or ()}, set(), []
    for name, tensor in saved["module"].items():
        if plain_name(name) not in buffers and storage_identity(tensor) not in seen:
            seen.add(storage_identity(tensor))
            params.append(name)
    shapes = {name: saved["module"][name].shape for name in params}
    return [[n for n in params if decays(shapes[n])], [n for n in params if not decays(shapes[n])]]


def _with_buffers_and_ties(mapped: MappedTorchFile, module: dict, masters: dict[str, Lazy]) -> dict:
    """Every entry of the module: a parameter's (or its tied name's) fp32 master, a buffer as saved."""
    master_of = {storage_identity(module[name]): lazy for name, lazy in masters.items()}
    return {
        name: master_of.get(storage_identity(tensor))
        or Lazy(tuple(tensor.shape), tensor.dtype, functools.partial(mapped.read, ("module", name)))
        for name, tensor in module.items()
    }


def _scaler(wrapper: dict) -> dict | None:
    """The wrapper's fp16 loss scale as GradScaler state; None for bf16 or a static scale."""
    if not wrapper.get("dynamic_loss_scale"):
        return None
    return loss_scale.from_deepspeed(types.SimpleNamespace(dynamic=True, **{k: wrapper[k] for k in SCALER_FIELDS}))

"""A DeepSpeed ZeRO 1-3 checkpoint read by parameter name, one tensor at a time, whatever its world size.

Each rank's optimizer file holds its partition of flat fp32 buffers, one per parameter (sub-)group, and AdamW's
exp_avg and exp_avg_sq over the same partitions; the model-states file holds the parameters' shapes per group,
the names that share a parameter (tied weights), the buffers and the scheduler.
- ZeRO 1-2: `param_slice_mappings` gives each parameter's fragment (start, numel) in a rank's partition; the
  parameter is its fragments in rank order (what DeepSpeed's ds_to_universal merges).
- ZeRO-3: every parameter of a sub-group takes ceil(numel / world) elements of each rank's partition, padded,
  one after the other in the order `param_shapes` lists them (what zero_to_fp32 reads).
"""

import functools
import math
import re
from pathlib import Path

import torch

from distsetup.training.checkpoint import loss_scale
from distsetup.training.checkpoint.streamed_io import Lazy, MappedTorchFile
from distsetup.training.model.blocks import plain_name

RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")  # bf16_zero_pp_rank_... in bf16
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO 1-2's, ZeRO-3's
MOMENTS = ("exp_avg", "exp_avg_sq")


def zero_state(path: Path, world: int, groups: list[list[str]] | None) -> dict:
    """{"model", "optimizer", "scheduler", "scaler"} of ZeRO 1-3 checkpoint folder `path` written by `world`
    ranks, weights and moments as Lazy tensors, the optimizer's parameters in the loading run's `groups` (names
    per param group; None: the weights alone, "optimizer" None), the fp16 loss scale as GradScaler state."""
    files = {int(m.group(1)): file for file in path.glob("*_optim_states.pt") if (m := RANK_FILE.search(file.name))}
    if sorted(files) != list(range(world)):
        raise ValueError(f"optimizer files of ranks {sorted(files)} where {world} ranks wrote it")
    model_file = next((path / name for name in MODEL_STATES if (path / name).exists()), None)
    if model_file is None:
        raise ValueError(f"no {MODEL_STATES[0]} or {MODEL_STATES[1]}")
    model_states = MappedTorchFile(model_file).load()  # ZeRO 1-2 keep the whole module in it: read no more
    if model_states.get("frozen_param_shapes"):
        raise ValueError("frozen parameters, which distsetup runs do not have")
    ranks = [MappedTorchFile(files[rank], shared_by=world) for rank in range(world)]
    first = ranks[0].load()["optimizer_state_dict"]
    stage3 = "fp32_flat_groups" in first
    shapes = {
        plain_name(n): (g, tuple(s)) for g, group in enumerate(model_states["param_shapes"]) for n, s in group.items()
    }
    if stage3:
        pieces = _zero3_pieces(model_states, world, [flat.numel() for flat in first["fp32_flat_groups"]])
    else:
        pieces = _zero12_pieces(ranks, shapes)
    missing = [name for names in groups or () for name in names if name not in shapes]
    if missing:
        raise ValueError(f"parameter {missing[0]} of this run's model is not in the checkpoint")

    def read(name: str, kind: str) -> torch.Tensor:
        group, shape = shapes[name]
        keys = _flat_keys(stage3, group, kind)
        parts = [ranks[rank].read(keys, slice(start, start + numel)) for rank, start, numel in pieces[name]]
        return torch.cat(parts)[: math.prod(shape)].view(shape)

    def lazy(name: str, kind: str) -> Lazy:
        return Lazy(shapes[name][1], torch.float32, functools.partial(read, name, kind), identity=(name, kind))

    tied = {plain_name(k): plain_name(v) for k, v in (model_states.get("shared_params") or {}).items()}
    model: dict[str, Lazy | torch.Tensor] = {name: lazy(name, "fp32") for name in shapes}
    model |= {alias: lazy(source, "fp32") for alias, source in tied.items()}
    model |= buffers(model_states)
    state = {"model": model, "optimizer": None, "scheduler": model_states["lr_scheduler"], "scaler": None}
    if groups is not None:
        inner = first["optimizer_state_dict" if stage3 else "base_optimizer_state"]
        state["optimizer"] = {
            "state": {
                name: {"step": _step(inner, shapes[name][0]), **{kind: lazy(name, kind) for kind in MOMENTS}}
                for names in groups
                for name in names
            },
            "param_groups": [_settings(inner, shapes[names[0]][0], names) for names in groups],
        }
        state["scaler"] = loss_scale.from_deepspeed(first.get("loss_scaler"))
    return state


def buffers(model_states: dict) -> dict[str, torch.Tensor]:
    """The model's buffers in DeepSpeed's model-states file, under their plain names. DeepSpeed names them as its
    engine's module does (`blocks.0._checkpoint_wrapped_module.norm.running_mean` under activation checkpointing) and
    keeps their values under the module's state-dict keys, from which the checkpoint wrapper leaves its own out."""
    named = {plain_name(name) for name in model_states.get("buffer_names") or ()}
    module = model_states.get("module") or {}
    return {plain_name(key): value.clone() for key, value in module.items() if plain_name(key) in named}


def _flat_keys(stage3: bool, group: int, kind: str) -> tuple:
    """Where a rank's optimizer file keeps its partition of (sub-)group `group`'s flat fp32 weights (`kind` "fp32")
    or of a moment over them."""
    if kind == "fp32":
        return ("optimizer_state_dict", "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups", group)
    return ("optimizer_state_dict", "optimizer_state_dict" if stage3 else "base_optimizer_state", "state", group, kind)


def _zero12_pieces(ranks: list[MappedTorchFile], shapes: dict) -> dict[str, list[tuple[int, int, int]]]:
    """Each parameter's fragments (rank, start, numel) in rank order."""
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for rank, file in enumerate(ranks):
        for mapping in file.load()["optimizer_state_dict"]["param_slice_mappings"]:
            for name, fragment in mapping.items():
                pieces.setdefault(plain_name(name), []).append((rank, fragment.start, fragment.numel))
    for name, (_, shape) in shapes.items():
        if sum(numel for _, _, numel in pieces.get(name, ())) != math.prod(shape):
            raise ValueError(f"the ranks' fragments of {name} do not make its {math.prod(shape)} elements")
    return pieces


def _zero3_pieces(model_states: dict, world: int, partition: list[int]) -> dict[str, list[tuple[int, int, int]]]:
    """Each parameter's (rank, start, numel) in every rank's partition of its sub-group (`partition`: each
    sub-group's partition size)."""
    pieces = {}
    for group, shapes in enumerate(model_states["param_shapes"]):
        offset = 0
        for name, shape in shapes.items():
            part = math.ceil(math.prod(shape) / world)
            pieces[plain_name(name)] = [(rank, offset, part) for rank in range(world)]
            offset += part
        if offset != partition[group]:  # each rank's partition is its shares, unpadded; not so over part (MiCS)
            raise ValueError(f"sub-group {group} is not spread over the {world} ranks evenly, as distsetup reads it")
    return pieces


def _step(inner: dict, group: int) -> torch.Tensor:
    """AdamW's step of (sub-)group `group`, as the tensor torch.optim keeps (DeepSpeed's CPU Adam keeps an int)."""
    return torch.tensor(float(inner["state"][group]["step"]))


def _settings(inner: dict, group: int, names: list[str]) -> dict:
    """A param group of the loading run: the settings of the checkpoint's param group that holds (sub-)group
    `group` (ZeRO-3 splits a param group into sub-groups: the inner optimizer's groups list their numbers)."""
    saved = next(saved for saved in inner["param_groups"] if group in saved["params"])
    return {**{k: v for k, v in saved.items() if k != "params"}, "params": list(names)}

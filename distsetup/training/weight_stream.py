"""A checkpoint's consolidated weights one tensor at a time: with training/safetensors_file.py, an export holds
about one tensor in memory beside the pages of the checkpoint it reads (memory-mapped), never the whole model
(DeepSpeed PR 4025: converting an 80B ZeRO-3 checkpoint took over 1 TB of RAM).

Streamed: single/DDP (state.pt) and FSDP (full_state.pt, or its DCP folder read one key at a time), ZeRO-3 (each
parameter cut from every rank's flat fp32 partition) and ZeRO-0 (its one model file). ZeRO 1-2 store flat
partitions padded per group in a layout DeepSpeed's zero_to_fp32 alone rebuilds: read whole, through it.
"""

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from distsetup.formats.checkpoint_folder import read_meta

ZERO3_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


@dataclass(frozen=True)
class WeightStream:
    """The tensors of a checkpoint, by name: their shapes and dtypes up front, each one read when asked for."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    read: Callable[[str], torch.Tensor]

    def tensors(self, names=None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.shapes if names is None else names:
            yield name, self.read(name)

    def renamed(self, rename: Callable[[str], str]) -> "WeightStream":
        """The same tensors under the names `rename` gives them."""
        original = {rename(name): name for name in self.shapes}
        return WeightStream(
            {new: self.shapes[name] for new, name in original.items()}, lambda new: self.read(original[new])
        )


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)  # what activation checkpointing adds to parameter names


def weight_stream(path: Path) -> WeightStream:
    """The consolidated model weights of checkpoint folder `path`, whatever backend and world size wrote it, named
    as in the plain model."""
    return _raw_stream(path).renamed(plain_name)


def plain_name(name: str) -> str:
    """A parameter's name without what wrappers (activation checkpointing) add to it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _raw_stream(path: Path) -> WeightStream:
    meta = read_meta(path)
    if meta.get("layout") == "universal":  # written by `distsetup checkpoint convert --to deepspeed`
        from distsetup.training import universal_folder

        return universal_folder.weights(path)
    if meta["backend"] in ("single", "ddp"):
        return _from_torch_file(path / "state.pt", "model")
    if meta["backend"] == "fsdp":
        if (path / "full_state.pt").exists():
            return _from_torch_file(path / "full_state.pt", "model")
        return _from_dcp(path / "model")
    if not meta.get("zero_stage"):
        return _from_torch_file(path / "mp_rank_00_model_states.pt", "module")
    if meta["zero_stage"] == 3 and (stream := _from_zero3(path, meta["world_size"])) is not None:
        return stream
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    whole = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    return WeightStream({k: (tuple(v.shape), v.dtype) for k, v in whole.items()}, whole.__getitem__)


def _from_torch_file(file: Path, key: str) -> WeightStream:
    state = torch.load(file, map_location="cpu", weights_only=False, mmap=True)[key]  # pages read when touched
    return WeightStream({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, state.__getitem__)


def _from_dcp(folder: Path) -> WeightStream:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    shapes = {
        key: (tuple(entry.size), entry.properties.dtype)
        for key, entry in entries.items()
        if isinstance(entry, TensorStorageMetadata)
    }

    def read(key: str) -> torch.Tensor:
        shape, dtype = shapes[key]
        one = {key: torch.empty(shape, dtype=dtype)}
        dcp.load(one, checkpoint_id=str(folder), no_dist=True)
        return one[key]

    return WeightStream(shapes, read)


def _from_zero3(path: Path, world: int) -> WeightStream | None:
    """ZeRO-3 gives each of the `world` ranks ceil(numel / world) elements of every parameter, padded, one parameter
    after the other in the flat fp32 partition of its sub-group; the model-states file lists the sub-groups'
    shapes and which names share a parameter (tied weights). None for layouts beyond that (frozen parameters,
    partitions not over the whole world): DeepSpeed's zero_to_fp32 reads those."""
    optim_files = {
        int(match.group(1)): file
        for file in path.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")  # bf16_zero_pp_rank_... in bf16
        if (match := ZERO3_RANK.search(file.name))
    }
    model_file = next(path.glob("zero_pp_rank_0_mp_rank_00_model_states.pt"), None)
    if sorted(optim_files) != list(range(world)) or model_file is None:
        return None
    model_states = torch.load(model_file, map_location="cpu", weights_only=False)
    if model_states.get("frozen_param_shapes"):
        return None
    flats = [
        torch.load(optim_files[rank], map_location="cpu", weights_only=False, mmap=True)["optimizer_state_dict"][
            "fp32_flat_groups"
        ]
        for rank in range(world)
    ]
    where: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # name -> (sub-group, offset in each partition, shape)
    for group, shapes in enumerate(model_states["param_shapes"]):
        offset = 0
        for name, shape in shapes.items():
            where[name] = (group, offset, tuple(shape))
            offset += math.ceil(math.prod(shape) / world)
        if any(offset > flat[group].numel() for flat in flats):  # not the layout described above
            return None
    for name, source in (model_states.get("shared_params") or {}).items():
        where.setdefault(name, where[source])
    buffer_names = model_states.get("buffer_names") or ()
    buffers = {k: v for k, v in model_states["module"].items() if k in buffer_names}

    def read(name: str) -> torch.Tensor:
        if name in buffers:
            return buffers[name]
        group, offset, shape = where[name]
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        return torch.cat([flat[group][offset : offset + part] for flat in flats])[:numel].view(shape)

    shapes = {name: (shape, torch.float32) for name, (_, _, shape) in where.items()}
    return WeightStream({**shapes, **{k: (tuple(v.shape), v.dtype) for k, v in buffers.items()}}, read)

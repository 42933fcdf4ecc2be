"""A checkpoint's consolidated weights one tensor at a time, and safetensors files written one tensor at a time:
an export holds about one tensor in memory beside the pages of the checkpoint it reads (memory-mapped), never the
whole model (DeepSpeed PR 4025: converting an 80B ZeRO-3 checkpoint took over 1 TB of RAM).

Streamed: single/DDP (state.pt) and FSDP (full_state.pt, or its DCP folder read one key at a time), ZeRO-3 (each
parameter cut from every rank's flat fp32 partition) and ZeRO-0 (its one model file). ZeRO 1-2 store flat
partitions padded per group in a layout DeepSpeed's zero_to_fp32 alone rebuilds: read whole, through it.
"""

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from distsetup.formats.checkpoint_folder import read_meta

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class WeightStream:
    """The tensors of a checkpoint, by name: their shapes and dtypes up front, each one read when asked for."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    read: Callable[[str], torch.Tensor]

    def tensors(self, names=None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.shapes if names is None else names:
            yield name, self.read(name)


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)  # what activation checkpointing adds to parameter names


def weight_stream(path: Path) -> WeightStream:
    """The consolidated model weights of checkpoint folder `path`, whatever backend and world size wrote it, named
    as in the plain model."""
    stream = _raw_stream(path)
    original = {_plain(name): name for name in stream.shapes}
    return WeightStream(
        {plain: stream.shapes[name] for plain, name in original.items()}, lambda plain: stream.read(original[plain])
    )


def _plain(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _raw_stream(path: Path) -> WeightStream:
    meta = read_meta(path)
    if meta["backend"] in ("single", "ddp"):
        return _from_torch_file(path / "state.pt", "model")
    if meta["backend"] == "fsdp":
        if (path / "full_state.pt").exists():
            return _from_torch_file(path / "full_state.pt", "model")
        return _from_dcp(path / "model")
    if meta.get("zero_stage") == 3:
        return _from_zero3(path)
    if not meta.get("zero_stage"):
        return _from_torch_file(path / "mp_rank_00_model_states.pt", "module")
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


def _from_zero3(path: Path) -> WeightStream:
    """ZeRO-3 gives each rank ceil(numel / world) elements of every parameter, padded, one parameter after the
    other in the flat fp32 partition of its sub-group; the model-states file lists the sub-groups' shapes."""
    optim_files = sorted(path.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)
    model_file = next(path.glob("zero_pp_rank_0_mp_rank_00_model_states.pt"))
    model_states = torch.load(model_file, map_location="cpu", weights_only=False)
    groups = model_states["param_shapes"]
    buffers = {k: v for k, v in model_states["module"].items() if k in model_states.get("buffer_names", ())}
    flats = [
        torch.load(f, map_location="cpu", weights_only=False, mmap=True)["optimizer_state_dict"]["fp32_flat_groups"]
        for f in optim_files
    ]
    world = len(flats)
    where: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # name -> (sub-group, offset in each partition, shape)
    for group, shapes in enumerate(groups):
        offset = 0
        for name, shape in shapes.items():
            where[name] = (group, offset, tuple(shape))
            offset += math.ceil(math.prod(shape) / world)

    def read(name: str) -> torch.Tensor:
        if name in buffers:
            return buffers[name]
        group, offset, shape = where[name]
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        pieces = [flat[group][offset : offset + part] for flat in flats]
        return torch.cat(pieces)[:numel].view(shape)

    shapes = {name: (shape, torch.float32) for name, (_, _, shape) in where.items()}
    return WeightStream({**shapes, **{k: (tuple(v.shape), v.dtype) for k, v in buffers.items()}}, read)


def _rank_of(file: Path) -> int:
    return int(file.name.split("_")[3])  # zero_pp_rank_R_mp_rank_00_optim_states.pt


def write_safetensors(file: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], tensors, metadata: dict):
    """A safetensors file of `entries` (name, shape, dtype, in file order), its data written one tensor at a
    time from the iterator `tensors` of (name, tensor) in the same order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for (name, shape, dtype), (got, tensor) in zip(entries, tensors, strict=True):
            assert name == got and tuple(tensor.shape) == tuple(shape), (name, got)
            out.write(tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy())

"""The whole training state of a checkpoint keyed by parameter names: weights, AdamW moments and steps, the
scheduler and the fp16 loss scaler, in the form torch.distributed.checkpoint's full state dicts take. Every backend
reads any other's checkpoint through it: the torch backends load it with set_model_state_dict and
set_optimizer_state_dict, DeepSpeed ZeRO 1-3 as a universal folder written from it (universal_folder.py).

Each layout is read lazily (`lazy_state`): weights and moments are streamed_io.Lazy tensors, read one at a time,
so `distsetup checkpoint convert` and export stream; a run that resumes loads the state made whole (`named_state`).
ZeRO 1-3's per-rank partitions are read by parameter name in zero_files.py.

A checkpoint's layout says what its files look like; two backends with the same layout load each other's
checkpoints as they are, at any world size (except ZeRO 1-3's, whose files are per rank).
"""

import copy
import functools
from pathlib import Path

import torch

from distsetup.formats.checkpoint_folder import Layout, Marker
from distsetup.training import optim
from distsetup.training.checkpoint import universal_folder, zero0_wrapper
from distsetup.training.checkpoint.streamed_io import (
    Lazy,
    MappedTorchFile,
    dcp_in_one_process,
    materialized,
    storage_identity,
)
from distsetup.training.checkpoint.weight_stream import WeightStream
from distsetup.training.checkpoint.zero_files import MOMENTS, zero_state
from distsetup.training.model.blocks import plain_name

ZERO0_FILE = "mp_rank_00_model_states.pt"  # ZeRO-0 keeps the module and the whole optimizer in it


def named_state(path: Path, source: Layout, groups: list[list[str]]) -> dict:
    """{"model", "optimizer", "scheduler", "scaler"} of checkpoint folder `path` in layout `source`, in memory, the
    optimizer keyed by parameter names in the loading run's param `groups` (see lazy_state)."""
    return materialized(lazy_state(path, source, groups))


LEGACY_HF_PREFIX = (
    "hf."  # a Hugging Face model's names where distsetup trained it in a wrapper (model section: layer_cls)
)


def weight_stream(path: Path) -> WeightStream:
    """The consolidated model weights of checkpoint folder `path`, whatever backend and world size wrote it, named
    as in the plain model, each read when asked for (a Hugging Face model's by its own names, also where an older
    distsetup wrapped it)."""
    marker = Marker.read(path)
    stream = WeightStream.of(lazy_state(path, marker.files_layout, None)["model"])
    if marker.legacy_hf_names:
        return stream.renamed(lambda name: name.removeprefix(LEGACY_HF_PREFIX))
    return stream


def lazy_state(path: Path, source: Layout, groups: list[list[str]] | None) -> dict:
    """The named state of checkpoint folder `path` in layout `source`, its weights and moments Lazy (read one at a
    time: streamed_io.py). `groups`: the parameter names in each param group of the optimizer that loads it, in
    its order; state.pt and ZeRO-0 number the parameters in that order (every backend builds its groups with
    training.optim.param_groups, so the numbers mean the same). None: the weights alone ("optimizer" None)."""
    if source == "universal":
        state = universal_folder.lazy_named_state(path, groups)
    elif source == "zero":
        state = zero_state(path, Marker.read(path).world_size, groups)
    elif source in ("state.pt", "zero0"):
        ours = source == "state.pt"  # else DeepSpeed's names
        state = _from_torch_file(path / ("state.pt" if ours else ZERO0_FILE), groups, ours)
    elif (path / "full_state.pt").exists():
        state = _from_torch_file(path / "full_state.pt", groups, ours=True, named=True)
    else:
        state = _from_dcp(path, groups)
    state["model"] = {plain_name(name): tensor for name, tensor in state["model"].items()}
    return state


def _from_torch_file(file: Path, groups: list[list[str]] | None, ours: bool, named: bool = False) -> dict:
    """state.pt or full_state.pt (`ours`), or ZeRO-0's model-states file; an optimizer keyed by numbers, or by
    names (`named`: FSDP's full state)."""
    mapped = MappedTorchFile(file)
    saved = mapped.load()
    keys = ("model", "optimizer", "scheduler") if ours else ("module", "optimizer", "lr_scheduler")

    def lazy(where: tuple, tensor: torch.Tensor) -> Lazy:
        return Lazy(
            tuple(tensor.shape),
            tensor.dtype,
            functools.partial(mapped.read, where),
            identity=storage_identity(tensor),
        )

    state = {
        "model": {name: lazy((keys[0], name), tensor) for name, tensor in saved[keys[0]].items()},
        "optimizer": None,
        "scheduler": copy.deepcopy(saved[keys[2]]),
        "scaler": copy.deepcopy(saved.get("scaler")),
    }
    if not ours and zero0_wrapper.holds_wrapper(saved[keys[1]]):  # ZeRO-0 in bf16/fp16
        return state | zero0_wrapper.lazy_named_state(mapped, saved, groups)
    if groups is not None:
        optimizer = saved[keys[1]]
        order = [name for names in groups for name in names]
        moments = {
            key: {
                k: lazy((keys[1], "state", key, k), v) if k in MOMENTS else copy.deepcopy(v) for k, v in value.items()
            }
            for key, value in optimizer["state"].items()
        }
        optimizer = {"state": moments, "param_groups": copy.deepcopy(optimizer["param_groups"])}
        state["optimizer"] = optimizer if named else optim.named(optimizer, order)
    return state


def _from_dcp(path: Path, groups: list[list[str]] | None) -> dict:
    """FSDP's DCP folders: model/ and optim/, keyed by names, each tensor read from its files when asked for."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def lazy_tensors(entries: dict, reader) -> dict[str, Lazy]:
        return {
            key: Lazy(
                tuple(entry.size),
                entry.properties.dtype,
                functools.partial(_dcp_tensor, reader, key, tuple(entry.size), entry.properties.dtype),
            )
            for key, entry in entries.items()
            if isinstance(entry, TensorStorageMetadata)
        }

    model_reader = _reading_metadata_once(path / "model")
    model = model_reader.read_metadata().state_dict_metadata
    scheduler = torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False)["scheduler"]
    state = {"model": lazy_tensors(model, model_reader), "optimizer": None, "scheduler": scheduler, "scaler": None}
    if groups is None:
        return state
    optim_reader = _reading_metadata_once(path / "optim")
    metadata = optim_reader.read_metadata()
    optimizer: dict = {}  # the steps and param groups read now, the moments when asked for, nested as saved
    moments = {key for key in metadata.state_dict_metadata if key.rsplit(".", 1)[-1] in MOMENTS}
    for key, entry in metadata.state_dict_metadata.items():
        if key not in moments:  # DCP fills tensors in place and puts the settings where the Nones are
            placeholder = (
                torch.empty(entry.size, dtype=entry.properties.dtype)
                if isinstance(entry, TensorStorageMetadata)
                else None
            )
            _put(optimizer, metadata.planner_data[key], placeholder)
    with dcp_in_one_process():
        dcp.load(optimizer, storage_reader=optim_reader, no_dist=True)
    lazy = lazy_tensors({key: metadata.state_dict_metadata[key] for key in moments}, optim_reader)
    for key in moments:
        _put(optimizer, metadata.planner_data[key], lazy[key])
    state["optimizer"] = optimizer
    return state


def _put(tree: dict, path: tuple, value) -> None:
    """tree[path[0]][path[1]]... = value, making the dicts (and lists, for numbered steps) on the way."""
    for key, following in zip(path[:-1], path[1:], strict=True):
        if isinstance(tree, list) and len(tree) <= key:
            tree.extend({} for _ in range(key + 1 - len(tree)))
        elif isinstance(tree, dict) and key not in tree:
            tree[key] = [] if isinstance(following, int) else {}
        tree = tree[key]
    tree[path[-1]] = value


def _reading_metadata_once(folder: Path):
    """DCP's reader of `folder`, which reads the folder's .metadata (where every tensor lies: megabytes for a model
    of thousands of tensors) once, not at each dcp.load: read a tensor at a time, a checkpoint took time quadratic in
    its tensors (2,071 of a 256-expert MoE: 4 minutes to export, against seconds from ZeRO-3's files)."""
    from torch.distributed.checkpoint import FileSystemReader

    class ReaderReadingMetadataOnce(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if not hasattr(self, "metadata_read"):
                self.metadata_read = super().read_metadata(*args, **kwargs)
            if (storage := self.metadata_read.storage_meta) is not None:  # this load's, as FileSystemReader sets
                storage.load_id = self.load_id
            return self.metadata_read

    return ReaderReadingMetadataOnce(str(folder))


def _dcp_tensor(reader, key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `key` (its flattened name) of the DCP folder `reader` reads."""
    import torch.distributed.checkpoint as dcp

    one = {key: torch.empty(shape, dtype=dtype)}  # a flat key DCP's flattening leaves as it is
    with dcp_in_one_process():
        dcp.load(one, storage_reader=reader, no_dist=True)
    return one[key]

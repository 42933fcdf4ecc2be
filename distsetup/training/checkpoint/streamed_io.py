"""Checkpoint tensors read and written one at a time, so that reading or rewriting a checkpoint holds about one
tensor in memory, never the whole state (DeepSpeed PR 4025: converting an 80B ZeRO-3 checkpoint took over 1 TB).

A state whose large tensors are `Lazy` leaves (shape, dtype, and how to read it) is written as a torch.save file
(`save_streamed`) or a torch.distributed.checkpoint folder (`save_dcp_streamed`) without materializing it, and
`materialized` makes it an ordinary state. torch.save files are read through memory maps (`MappedTorchFile`)
dropped and made anew every MAPPED_BYTES read: the pages a mapping has read stay resident until it goes.
"""

import contextlib
import mmap
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from distsetup.errors import first_line

MAPPED_BYTES = 64 * 2**20  # read (or written) through one memory map before it is dropped


@dataclass(frozen=True)
class Lazy:
    """A tensor of a checkpoint not read yet. `identity` is the same for two names of one tensor (tied weights)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]
    identity: object = None


def storage_identity(tensor: torch.Tensor) -> tuple:
    """The same for two names of one saved tensor (tied weights), as torch.load gives them back."""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset()


def item_at(tree: Any, keys: tuple) -> Any:
    """tree[keys[0]][keys[1]]..."""
    for key in keys:
        tree = tree[key]
    return tree


def read(leaf):
    """A Lazy leaf read; anything else as it is."""
    return leaf.read() if isinstance(leaf, Lazy) else leaf


def materialized(state):
    """`state` with each Lazy leaf read."""
    return tree_map(read, state)


@contextlib.contextmanager
def dcp_in_one_process():
    """torch.distributed.checkpoint run by this process alone, with no process group: it warns that it assumes so,
    which is as meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def shape_and_dtype(leaf) -> tuple[tuple[int, ...], torch.dtype]:
    return (leaf.shape, leaf.dtype) if isinstance(leaf, Lazy) else (tuple(leaf.shape), leaf.dtype)


class MappedTorchFile:
    """A torch.save file whose tensors are read (copied out) through a memory map, remapped every MAPPED_BYTES read
    (a share of it where `shared_by` files are read at once)."""

    def __init__(self, file: Path, shared_by: int = 1):
        self.file = file
        self.budget = MAPPED_BYTES // shared_by
        self._loaded = None
        self._read_bytes = 0

    def load(self) -> Any:
        """The file's object, its tensors memory-mapped (read when touched); for listing, not to be kept."""
        if not zipfile.is_zipfile(self.file):  # torch's own message would ask for another way of saving it
            raise ValueError(f"{self.file.name} is not a torch.save archive (damaged or cut short)")
        try:
            return torch.load(self.file, map_location="cpu", weights_only=False, mmap=True)
        except OSError:  # names the file itself
            raise
        except Exception as e:  # damaged content: torch's message does not say which file
            raise ValueError(f"{self.file.name}: {first_line(e)}") from e

    def read(self, keys: tuple, part: slice | None = None) -> torch.Tensor:
        """A copy of the tensor (its `part`) at `keys`, the path to it in the file's object."""
        if self._loaded is None or self._read_bytes > self.budget:
            self._loaded, self._read_bytes = None, 0  # the old map goes before the new one comes
            self._loaded = self.load()
        found = item_at(
            self._loaded, keys
        ).detach()  # DeepSpeed saves its fp32 partitions requiring grad: a slice would carry a graph
        tensor = (found if part is None else found[part]).clone()
        self._read_bytes += tensor.nbytes
        return tensor


def save_streamed(state, file: Path) -> None:
    """torch.save(materialized(state), file), one tensor in memory at a time: torch writes the file with shapes
    alone (`skip_data`), then each tensor is copied into its place through a shared memory map of the file."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    leaves = [leaf for leaf in tree_flatten(state)[0] if isinstance(leaf, (Lazy, torch.Tensor))]
    with FakeTensorMode():  # a storage of its own for every tensor, never allocated

        def shapes_only(leaf):
            if not isinstance(leaf, (Lazy, torch.Tensor)):
                return leaf
            shape, dtype = shape_and_dtype(leaf)
            return torch.empty(shape, dtype=dtype)

        skeleton = tree_map(shapes_only, state)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, file)
    records = [name for name in torch._C.PyTorchFileReader(str(file)).get_all_records() if "/data/" in f"/{name}"]
    if len(records) != len(leaves):  # a tensor inside an object the tree walk does not open would stay empty
        raise ValueError(f"{file}: {len(records)} tensors written where {len(leaves)} were given")
    written, place = 0, None
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        for i, leaf in enumerate(leaves):
            if place is None or written > MAPPED_BYTES:
                place, written = None, 0  # the old map goes before the new one comes
                mapped = tree_flatten(torch.load(file, map_location="cpu", mmap=True, weights_only=False))[0]
                place = [t for t in mapped if isinstance(t, torch.Tensor)]
            tensor = read(leaf)
            place[i].copy_(tensor)
            written += tensor.nbytes


def save_dcp_streamed(state: dict, folder: Path) -> None:
    """A torch.distributed.checkpoint folder of `state` (any world size loads it, resharded), written by this one
    process with each Lazy leaf read only when its bytes are written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class ReadWhenWritten(DefaultSavePlanner):
        def lookup_object(self, index):
            leaf = state
            for key in self.mappings[index.fqn]:  # the path to it in the nested state (DCP flattens it)
                leaf = leaf[key]
            return read(leaf)

    def planned(leaf):  # DCP plans from shapes and dtypes; meta tensors carry them
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta") if isinstance(leaf, Lazy) else leaf

    with dcp_in_one_process():
        # a file per tensor: DCP's writer keeps each tensor of a file until the file is done
        writer = dcp.FileSystemWriter(folder, single_file_per_rank=False)
        dcp.save(tree_map(planned, state), storage_writer=writer, no_dist=True, planner=ReadWhenWritten())

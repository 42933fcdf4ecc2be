"""Pretrained weights read a slice at a time, so that no rank reads or holds the whole model (FSDP2, ZeRO-3).

Where the run starts from a checkpoint that holds every parameter (a Hugging Face folder's safetensors, or an
`--init_from` export), no rank builds the model with its values: every rank builds a skeleton (`skeleton()`: the
parameters on the meta device, the buffers real, as Accelerate's `init_empty_weights(include_buffers=False)`), and
the values come from the checkpoint:
- FSDP2: each rank reads only the rows of its own shards (`fill_shards`): safetensors' `get_slice`, or a slice of
  the export mapped into memory;
- ZeRO-3: rank 0 reads one parameter at a time into DeepSpeed's gathered parameter, which it then partitions (the
  backend's `construct`), as transformers loads a checkpoint under ZeRO-3.
Buffers are every rank's own, built with the skeleton (rotary frequencies, causal masks: in no checkpoint), then
rank 0's broadcast; persistent ones that the checkpoint holds are read from it.
"""

import copy
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.training.model.build import architecture_on_meta, build
from distsetup.training.model.from_rank0 import broadcast_buffers, unwrapped

SAFETENSORS_INDEX = "model.safetensors.index.json"


class Pretrained:
    """The tensors of a checkpoint by name, each read only as far as asked (a range of its rows); `bytes_read` counts
    what was read. `path`: a Hugging Face folder with safetensors (one file, or shards with their index), a
    safetensors file (`distsetup checkpoint export`'s), or a file from `--export` (torch.save, mapped: a slice reads
    only its pages)."""

    def __init__(self, path: Path):
        self.path, self.bytes_read = path, 0
        self._shapes: dict[str, list[int]] = {}
        self._mapped: dict[str, torch.Tensor] = {}
        if path.is_dir() and (path / SAFETENSORS_INDEX).exists():
            self._where = dict(json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"])
        elif path.is_dir() or path.suffix == ".safetensors":
            file = path.name if path.suffix == ".safetensors" else "model.safetensors"
            with self._open(file) as f:
                self._where = {name: file for name in f.keys()}
        else:
            self._mapped = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            self._where = {}

    def close(self) -> None:
        """Unmap the export (its pages read count in this process's resident memory while it is mapped)."""
        self._mapped = {}

    @property
    def export(self) -> dict[str, torch.Tensor] | None:
        """An `--export` file's tensors, mapped (None for safetensors)."""
        return self._mapped or None

    @property
    def names(self) -> set[str]:
        return set(self._mapped) | set(self._where)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `start:stop` of tensor `name` (for a 0-d tensor: itself)."""
        if name in self._mapped:
            value = self._mapped[name]
            value = (value if value.dim() == 0 else value[start:stop]).clone()
        else:  # the file mapped for this read alone: the pages read leave this process with it
            with self._open(self._where[name]) as f:
                part = f.get_slice(name)
                value = part[:] if len(part.get_shape()) == 0 else part[start:stop]
        self.bytes_read += value.numel() * value.element_size()
        return value

    def whole(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 0)

    def shape(self, name: str) -> list[int]:
        if name in self._mapped:
            return list(self._mapped[name].shape)
        if name not in self._shapes:
            with self._open(self._where[name]) as f:
                self._shapes.update((key, f.get_slice(key).get_shape()) for key in f.keys())
        return list(self._shapes[name])

    def same(self, a: str, b: str) -> bool:
        """Whether tensors `a` and `b` hold the same values, compared a block of rows at a time (a check, not a load:
        not counted in bytes_read)."""
        shape = self.shape(a)
        if shape != self.shape(b):
            return False
        read, rows = self.bytes_read, shape[0] if shape else 1
        block = max(1, 2**24 // max(1, math.prod(shape[1:])))  # about 16M values at a time
        try:
            return all(
                torch.equal(self.rows(a, i, i + block), self.rows(b, i, i + block)) for i in range(0, rows, block)
            )
        finally:
            self.bytes_read = read

    def _open(self, file: str):
        from safetensors import safe_open

        folder = self.path if self.path.is_dir() else self.path.parent
        return safe_open(str(folder / file), framework="pt")


def source_of(m, init_from: str | None) -> Pretrained | None:
    """The checkpoint the run starts from, where it can be read a slice at a time: `--init_from`'s export, or the
    model section `m`'s Hugging Face folder where its weights are safetensors; None for a fresh model."""
    if init_from:
        try:
            return Pretrained(Path(init_from))
        except Exception:  # not a torch.save file: load_weights says so, in one line
            return None
    if m.type == "hf" and Path(m.hf_path).is_dir():
        folder = Path(m.hf_path)
        if (folder / SAFETENSORS_INDEX).exists() or (folder / "model.safetensors").exists():
            return Pretrained(folder)
    return None


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several (tied embeddings: embed_tokens and lm_head)."""
    by_parameter: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_parameter.setdefault(id(parameter), []).append(name)
    return [names for names in by_parameter.values() if len(names) > 1]


def check_ties_of(m, init_from: str | None, source: Pretrained | None = None) -> None:
    """check_ties for the run's weights (`--init_from`'s export, model section `m`'s Hugging Face folder), if any,
    against the model's ties as its config makes them (built on the meta device). `source`: the weights, mapped
    already (else mapped for the check alone)."""
    own = None if source is not None else source_of(m, init_from)
    weights = source or own
    if weights is None:
        return
    described = f"--init_from {init_from}" if init_from else f"model.hf_path {m.hf_path}"
    try:
        check_ties(weights, architecture_on_meta(m), described)
    finally:
        if own is not None:
            own.close()


def check_ties(source: Pretrained, model: nn.Module, described: str) -> None:
    """`source` holds one value under the names `model` ties: where it holds two, each backend would keep another
    (load_state_dict the last name's, the readers of slices the first's), and transformers unties such a model on
    the rank that loads it whole, which then has other parameters than the rest."""
    for names in tied_names(model):
        held = [name for name in names if name in source.names]
        for other in held[1:]:
            if not source.same(held[0], other):
                raise DistsetupError(
                    f"{described} holds different values for {held[0]} and {other}, which the model ties (one "
                    "parameter).",
                    "untie the model (tie_word_embeddings: false in a Hugging Face model's config.json), or start "
                    "from weights that hold one value for both.",
                )


def covers(source: Pretrained, skeleton: nn.Module) -> bool:
    """Whether `source` holds every parameter of `skeleton` with its shape, and the skeleton has every buffer (else
    the model is built whole on rank 0: as the library that made it would fill the rest, transformers initialising a
    new head; as its constructor computes a buffer from a parameter, which is on the meta device in a skeleton)."""
    names = source.names
    if any(buffer.is_meta for buffer in skeleton.buffers()):
        return False
    return all(
        name in names and source.shape(name) == list(parameter.shape) for name, parameter in skeleton.named_parameters()
    )


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside put each parameter on the meta device as it is registered, and their buffers where their
    constructors put them (Accelerate's init_empty_weights with include_buffers=False)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta:  # one already there: a tie, kept one object
            module._parameters[name] = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(m) -> nn.Module:
    """The model section `m`'s model with its parameters on the meta device and its buffers built."""
    with parameters_on_meta():
        return build(m, weights=False)


def runnable_copy(skeleton: nn.Module) -> nn.Module:
    """A copy of `skeleton` that a forward can run on (rank 0's Hugging Face head check): its parameters allocated
    on the CPU but never written, so that only a forward that reads them makes them resident, and its buffers as
    built."""
    built = {name: buffer.clone() for name, buffer in skeleton.named_buffers(remove_duplicate=False)}
    probe = copy.deepcopy(skeleton)  # its ties kept: deepcopy copies a shared Parameter once
    probe.to_empty(device="cpu")
    with torch.no_grad():
        for name, buffer in probe.named_buffers():
            buffer.copy_(built[name])
    return probe


def fill_shards(
    model: nn.Module, source: Pretrained, buffers: dict[str, torch.Tensor], buffers_on: torch.device, is_main: bool
) -> None:
    """Each of FSDP2's shards (allocated, uninitialised) filled with its own rows of `source`, and every buffer onto
    `buffers_on`: rank 0's (`buffers`: each rank's as built) broadcast, the checkpoint's where it holds one. A
    collective."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            sharded: Any = parameter  # a DTensor
            local = sharded.to_local()
            mesh, placements = sharded.device_mesh, sharded.placements
            shape, offset = compute_local_shape_and_global_offset(sharded.shape, mesh, placements)
            if local.numel() == 0:
                continue
            rows = source.rows(unwrapped(name), offset[0], offset[0] + shape[0])
            columns = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
            local.copy_(rows[(slice(None),) + columns])
    broadcast_buffers(model, buffers, buffers_on, is_main)
    read_persistent_buffers(model, source)


def read_persistent_buffers(model: nn.Module, source: Pretrained) -> None:
    """The buffers the checkpoint holds (persistent ones), read from it on every rank (they are small)."""
    names = source.names
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if unwrapped(name) in names:
                buffer.copy_(source.whole(unwrapped(name)))

"""A checkpoint's consolidated weights one tensor at a time (named_state.weight_stream reads any checkpoint as one):
with training/checkpoint/safetensors_file.py, an export holds about one tensor in memory, never the whole model."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from distsetup.training.checkpoint.streamed_io import read, shape_and_dtype


@dataclass(frozen=True)
class WeightStream:
    """The tensors of a checkpoint, by name: their shapes and dtypes up front, each one read when asked for."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    read: Callable[[str], torch.Tensor]

    def tensors(self, names=None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.shapes if names is None else names:
            yield name, self.read(name)

    @staticmethod
    def of(tensors: dict) -> "WeightStream":
        """The tensors of a named state's model (real, or streamed_io.Lazy) as a stream."""

        return WeightStream(
            {name: shape_and_dtype(tensor) for name, tensor in tensors.items()}, lambda name: read(tensors[name])
        )

    def renamed(self, rename: Callable[[str], str]) -> "WeightStream":
        """The same tensors under the names `rename` gives them."""
        original = {rename(name): name for name in self.shapes}
        return WeightStream(
            {new: self.shapes[name] for new, name in original.items()}, lambda new: self.read(original[new])
        )

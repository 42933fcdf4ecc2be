"""Batches on the device, step after step, for any map-style dataset.

A torch DataLoader reads this rank's micro-batches in the order the ShardedSampler gives them (ahead of the step, in
data.num_workers worker processes; into pinned memory on GPUs), collated by the dataset's collate function. The
loader reads from its own copy of the sampler; the sampler the trainer saves in checkpoints advances only with the
steps taken, so the data position a checkpoint records is exact however far the workers have read ahead.
"""

import copy
import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader

from distsetup.training.data import ShardedSampler


class StepLoader:
    """This rank's micro-batches for each optimizer step, on `device`."""

    def __init__(self, dataset, sampler: ShardedSampler, collate: Callable, num_workers: int, device: torch.device):
        self.sampler, self.device = sampler, device
        ahead = copy.deepcopy(sampler)  # what the loader has asked for; `sampler` is what the loop has taken
        self._batches: Iterator = iter(_loader(dataset, _MicroBatches(ahead), collate, num_workers, device))

    def next_step(self) -> list:
        """The micro-batches of the next optimizer step (the sampler advances by one step)."""
        self.sampler.next_step()
        return [to_device(next(self._batches), self.device) for _ in range(self.sampler.accumulation)]

    def close(self) -> None:
        """Stop the worker processes (the DataLoader's iterator does as it goes)."""
        self._batches = iter(())


class _MicroBatches:
    """The sampler's micro-batches of sample indices, one step after another, without end (epochs roll over)."""

    def __init__(self, sampler: ShardedSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            for indices in self.sampler.next_step():
                yield indices.tolist()


def validation_batches(dataset, micro: int, rank: int, world_size: int, collate: Callable, num_workers: int, device):
    """(batch on `device`, samples it counts) for each of this rank's validation micro-batches: samples rank,
    rank + world, ... in batches of `micro`. Every rank takes as many batches as the rank with the most samples, so
    that FSDP and ZeRO-3 gather parameters with the others; a rank out of samples repeats its first one, uncounted."""
    mine = list(range(rank, len(dataset), world_size))
    most = math.ceil(len(dataset) / world_size)
    chunks = [mine[start : start + micro] for start in range(0, most, micro)]
    counts = [len(chunk) for chunk in chunks]
    batches = _loader(dataset, [chunk or mine[:1] for chunk in chunks], collate, num_workers, device)
    for batch, counted in zip(batches, counts, strict=True):
        yield to_device(batch, device), counted


def fetched(dataset, indices: list[int], collate: Callable):
    """The batch of samples `indices`, as a DataLoader fetches it (a dataset's __getitems__, where it has one)."""
    if hasattr(dataset, "__getitems__"):
        return collate(dataset.__getitems__(indices))
    return collate([dataset[i] for i in indices])


def _loader(dataset, batch_sampler, collate: Callable, num_workers: int, device: torch.device) -> DataLoader:
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )


def to_device(batch, device: torch.device):
    """Every tensor in `batch` (a tensor, or dicts, lists and tuples of them) on `device`; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(value, device) for value in batch)
    return batch

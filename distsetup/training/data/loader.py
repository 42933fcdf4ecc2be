"""Batches on the device, step after step, for any map-style dataset.

A torch DataLoader reads this rank's micro-batches in the order the ShardedSampler gives them (ahead of the step, in
data.num_workers worker processes; into pinned memory on GPUs), collated by the dataset's collate function. The
loader reads from its own copy of the sampler; the sampler the trainer saves in checkpoints advances only with the
steps taken, so the data position a checkpoint records is exact however far the workers have read ahead. Each
loader seeds its workers from a generator of its own: torch's global one (dropout's) is left as an uninterrupted run
leaves it.

How the workers start, and end with the rank: worker_processes.py.
"""

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from distsetup.training.data import worker_processes
from distsetup.training.data.batch_errors import said_in_one_line
from distsetup.training.data.datasets import ShardedSampler


@dataclass(frozen=True)
class Placement:
    """Where batches go: the device, and the dtype floating-point tensors take there (None: their own; a DeepSpeed
    engine in bf16 or fp16 holds its weights in that dtype and casts no input, so they are cast as the HF Trainer
    casts them)."""

    device: torch.device
    float_dtype: torch.dtype | None = None


class StepLoader:
    """This rank's micro-batches for each optimizer step, placed as `placement` says."""

    def __init__(
        self,
        dataset,
        sampler: ShardedSampler,
        collate: Callable,
        num_workers: int,
        placement: Placement,
        collating: str | None = None,
    ):
        """`collating`: for the user's samples, what batches them (Datasets.collating)."""
        self.sampler, self.placement = sampler, placement
        ahead = copy.deepcopy(sampler)  # what the loader has asked for; `sampler` is what the loop has taken
        seed = sampler.seed + sampler.rank  # the workers' seeds, as DistributedSampler users seed theirs
        batches = _MicroBatches(ahead)
        self._batches: Iterator = _started(dataset, batches, collate, num_workers, placement, seed, sampler.rank)
        self._said = said_in_one_line(self._batches, collating) if collating else self._batches

    def next_step(self) -> list:
        """The micro-batches of the next optimizer step (the sampler advances by one step)."""
        self.sampler.next_step()
        return [placed(next(self._said), self.placement) for _ in range(self.sampler.accumulation)]

    def close(self) -> None:
        """Stop the worker processes (worker_processes.shut_down)."""
        batches, self._batches = self._batches, iter(())
        self._said = self._batches  # nothing keeps the workers' queues: their semaphores go before the interpreter
        worker_processes.shut_down(batches)


class _MicroBatches:
    """The sampler's micro-batches of sample indices, one step after another, without end (epochs roll over)."""

    def __init__(self, sampler: ShardedSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            for indices in self.sampler.next_step():
                yield indices.tolist()


def validation_batches(
    dataset,
    micro: int,
    rank: int,
    world_size: int,
    collate: Callable,
    num_workers: int,
    placement: Placement,
    collating: str | None = None,
):
    """(batch, samples it counts) for each of this rank's validation micro-batches: samples rank, rank + world, ...
    in batches of `micro`. Every rank takes as many batches as the rank with the most samples, so that FSDP and ZeRO-3
    gather parameters with the others; a rank out of samples repeats its first one, uncounted. `collating`: as for
    StepLoader."""
    mine = list(range(rank, len(dataset), world_size))
    most = math.ceil(len(dataset) / world_size)
    chunks = [mine[start : start + micro] for start in range(0, most, micro)]
    counts = [len(chunk) for chunk in chunks]
    micro_batches = [chunk or mine[:1] for chunk in chunks]
    loaded = batches = _started(dataset, micro_batches, collate, num_workers, placement, rank, rank)
    if collating:
        batches = said_in_one_line(batches, collating)
    try:
        for batch, counted in zip(batches, counts, strict=True):
            yield placed(batch, placement), counted
    finally:  # also where the ranks agreed to stop before the end (evaluation.py closes this generator)
        worker_processes.shut_down(loaded)


def fetched(dataset, indices: list[int], collate: Callable):
    """The batch of samples `indices`, as a DataLoader fetches it (a dataset's __getitems__, where it has one)."""
    if hasattr(dataset, "__getitems__"):
        return collate(dataset.__getitems__(indices))
    return collate([dataset[i] for i in indices])


def _started(
    dataset, batch_sampler: Iterable, collate: Callable, workers: int, placement: Placement, seed: int, rank: int
) -> Iterator:
    """The batches of a DataLoader over `batch_sampler`, its `workers` started as worker_processes.py says."""

    def loader(context: str | None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate,
            num_workers=workers,
            worker_init_fn=worker_processes.serve_the_rank,
            multiprocessing_context=context,
            pin_memory=placement.device.type == "cuda",
            generator=torch.Generator().manual_seed(seed),  # not torch's global generator: see the module's docstring
        )

    if workers == 0:
        return iter(loader(None))
    return worker_processes.started(loader, placement.device, rank)


def placed(batch, placement: Placement):
    """Every tensor in `batch` (a tensor, or dicts, lists and tuples of them) where `placement` says; anything else
    as it is."""
    if isinstance(batch, torch.Tensor):
        cast = placement.float_dtype if batch.is_floating_point() else None
        return batch.to(placement.device, dtype=cast, non_blocking=True)
    if isinstance(batch, dict):
        return {key: placed(value, placement) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(placed(value, placement) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(placed(value, placement) for value in batch)
    return batch

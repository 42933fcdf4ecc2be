"""Batches on the device, step after step, for any map-style dataset.

A torch DataLoader reads this rank's micro-batches in the order the ShardedSampler gives them (ahead of the step, in
data.num_workers worker processes; into pinned memory on GPUs), collated by the dataset's collate function. The
loader reads from its own copy of the sampler; the sampler the trainer saves in checkpoints advances only with the
steps taken, so the data position a checkpoint records is exact however far the workers have read ahead. Each
loader seeds its workers from a generator of its own: torch's global one (dropout's) is left as an uninterrupted run
leaves it.

Where forking the rank can deadlock, the workers start from a fork server instead (a process started once per
rank, with torch imported): under CPython 3.11 and older, on the CPU. There the rank's gradients go through gloo,
whose threads enter Python as they let go of each collective launched in backward (torch keeps the backward's
contextvars in the collective's thread-local state), and CPython 3.11 deadlocks a child forked while a thread
does: PyOS_AfterFork_Child waits for the runtime's lock before it makes it anew. The pairwise scorer's test runs hung
so now and then; started beside threads entering Python, 10 loaders in 1400 hung forked, none from the server.
Elsewhere they are forked from the rank, sharing its memory: CPython 3.12 makes the lock anew first, and on a GPU
NCCL's work objects hold no Python state (ProcessGroupNCCL.hpp; gloo's AsyncWork keeps the thread-local state) and
autograd's device threads keep their Python thread state for good (read, not run on a GPU). A dataset the server's
workers cannot be given (one that cannot be pickled, or holds more than about 240 tensors: their storages go as
file descriptors, 253 to a message) is forked from the rank, with a note.

Neither the server nor a worker answers the signals that stop a run (STOP_SIGNALS): a launcher or SLURM sends them
to every process of a rank, and a worker that died of one would fail the rank's next batch ("DataLoader worker ...
killed by signal") before the rank could checkpoint. The rank ends its workers as it ends, and a worker leaves as
soon as its rank is gone.
"""

import atexit
import contextlib
import copy
import functools
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401 - its exit function registered before this module's (_end_workers_left)
import os
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from distsetup.errors import first_line
from distsetup.training.data.datasets import ShardedSampler

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # the rank's to answer (training/preemption.py)
QUEUE_FEEDER_WAIT_S = 5.0  # a closed queue's thread ends at once; a rank never waits long on a stuck one


@dataclass(frozen=True)
class Placement:
    """Where batches go: the device, and the dtype floating-point tensors take there (None: their own; a DeepSpeed
    engine in bf16 or fp16 holds its weights in that dtype and casts no input, so they are cast as the HF Trainer
    casts them)."""

    device: torch.device
    float_dtype: torch.dtype | None = None


class StepLoader:
    """This rank's micro-batches for each optimizer step, placed as `placement` says."""

    def __init__(self, dataset, sampler: ShardedSampler, collate: Callable, num_workers: int, placement: Placement):
        self.sampler, self.placement = sampler, placement
        ahead = copy.deepcopy(sampler)  # what the loader has asked for; `sampler` is what the loop has taken
        seed = sampler.seed + sampler.rank  # the workers' seeds, as DistributedSampler users seed theirs
        batches = _MicroBatches(ahead)
        self._batches: Iterator = _started(dataset, batches, collate, num_workers, placement, seed, sampler.rank)

    def next_step(self) -> list:
        """The micro-batches of the next optimizer step (the sampler advances by one step)."""
        self.sampler.next_step()
        return [placed(next(self._batches), self.placement) for _ in range(self.sampler.accumulation)]

    def close(self) -> None:
        """Stop the worker processes, also where an exception's traceback still holds the DataLoader's iterator, and
        wait for the threads that fed the loaders' queues to end: they hold the queues' semaphores, which the fork
        server's resource tracker would otherwise find left behind, and warn of, once the rank has left without the
        interpreter's teardown (distsetup/train.py exit_now)."""
        batches, self._batches = self._batches, iter(())
        getattr(batches, "_shutdown_workers", lambda: None)()  # torch's, as when the iterator is freed
        for queue in list(_INDEX_QUEUES):
            feeder = getattr(queue, "_thread", None)  # multiprocessing.Queue's, ending once the queue is closed
            if feeder is not None and getattr(queue, "_closed", False):  # not another live loader's
                feeder.join(timeout=QUEUE_FEEDER_WAIT_S)


class _MicroBatches:
    """The sampler's micro-batches of sample indices, one step after another, without end (epochs roll over)."""

    def __init__(self, sampler: ShardedSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            for indices in self.sampler.next_step():
                yield indices.tolist()


def validation_batches(
    dataset, micro: int, rank: int, world_size: int, collate: Callable, num_workers: int, placement: Placement
):
    """(batch, samples it counts) for each of this rank's validation micro-batches: samples rank, rank + world, ...
    in batches of `micro`. Every rank takes as many batches as the rank with the most samples, so that FSDP and ZeRO-3
    gather parameters with the others; a rank out of samples repeats its first one, uncounted."""
    mine = list(range(rank, len(dataset), world_size))
    most = math.ceil(len(dataset) / world_size)
    chunks = [mine[start : start + micro] for start in range(0, most, micro)]
    counts = [len(chunk) for chunk in chunks]
    micro_batches = [chunk or mine[:1] for chunk in chunks]
    batches = _started(dataset, micro_batches, collate, num_workers, placement, rank, rank)
    for batch, counted in zip(batches, counts, strict=True):
        yield placed(batch, placement), counted


def fetched(dataset, indices: list[int], collate: Callable):
    """The batch of samples `indices`, as a DataLoader fetches it (a dataset's __getitems__, where it has one)."""
    if hasattr(dataset, "__getitems__"):
        return collate(dataset.__getitems__(indices))
    return collate([dataset[i] for i in indices])


def _started(
    dataset, batch_sampler: Iterable, collate: Callable, workers: int, placement: Placement, seed: int, rank: int
) -> Iterator:
    """The batches of a DataLoader over `batch_sampler`, its `workers` started as the module's docstring says."""

    def loader(context: str | None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate,
            num_workers=workers,
            worker_init_fn=_serve_the_rank,
            multiprocessing_context=context,
            pin_memory=placement.device.type == "cuda",
            generator=torch.Generator().manual_seed(seed),  # not torch's global generator: see the module's docstring
        )

    if workers == 0:
        return iter(loader(None))
    if _forking_can_deadlock(placement):
        try:
            with warnings.catch_warnings():  # torch's words for a pickling error, which suggest fork for everything
                warnings.filterwarnings("ignore", "Got pickle error when attempting to start a worker")
                return _kept(iter(loader(_fork_server())))
        except Exception as e:  # whatever stops the server's workers (pickling, too many file descriptors)
            if rank == 0:
                _note_forked_from_the_rank(f"{type(e).__name__}: {first_line(e)}")
    with _stop_signals_blocked():  # the forked workers keep them blocked
        return _kept(iter(loader("fork")))


# The loaders' worker processes and the queues this rank feeds them indices through, while they exist
_WORKERS: "weakref.WeakSet[multiprocessing.process.BaseProcess]" = weakref.WeakSet()
_INDEX_QUEUES: weakref.WeakSet = weakref.WeakSet()


def _kept(batches: Iterator) -> Iterator:
    """`batches`, a DataLoader's iterator with workers, its workers and index queues kept in _WORKERS and
    _INDEX_QUEUES (torch's attributes; none where torch has other names for them)."""
    _WORKERS.update(getattr(batches, "_workers", ()))
    _INDEX_QUEUES.update(getattr(batches, "_index_queues", ()))
    return batches


def _forking_can_deadlock(placement: Placement) -> bool:
    """Whether a worker forked from the rank can deadlock: under CPython 3.11 and older, where the rank's gradients
    go through gloo, whose threads enter Python (see the module's docstring)."""
    return sys.version_info < (3, 12) and placement.device.type == "cpu"


def _fork_server() -> str:
    """The start method of workers forked from the fork server, started (or started again, where it died) with
    torch imported and STOP_SIGNALS blocked: the server and every worker it forks inherit the mask. So does the
    resource tracker the server needs, started first: it blocks SIGINT and SIGTERM for itself, and unblocks them in
    this thread as it returns."""
    from multiprocessing import forkserver, resource_tracker

    forkserver.set_forkserver_preload(["torch", __name__])
    # Linux passes 253 file descriptors in a message at most (SCM_MAX_FD): past that CPython 3.11's server, sent
    # none, ended, and every loader's workers with it; at this bound the client refuses first (ValueError)
    vars(forkserver)["MAXFDS_TO_SEND"] = min(forkserver.MAXFDS_TO_SEND, 253 + 1)
    with _stop_signals_blocked():
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    return "forkserver"


@contextlib.contextmanager
def _stop_signals_blocked():
    """STOP_SIGNALS blocked in this thread (a process started meanwhile inherits the mask), then as they were: one
    that came meanwhile is answered then."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@functools.cache  # once for each dataset, not at each evaluation
def _note_forked_from_the_rank(why: str) -> None:
    print(
        f"note: data.num_workers: the dataset cannot go to workers of the fork server ({why}), so they are forked "
        "from the rank, which can deadlock under CPython 3.11 (see distsetup/training/data/loader.py); make it "
        "picklable (no lambdas, open files or locally defined classes in it) and hold fewer than 240 tensors.",
        flush=True,
    )


def _serve_the_rank(worker_id: int) -> None:
    """A worker serves the rank until the rank ends it, or ends: it ignores STOP_SIGNALS too (blocked already), and
    leaves as soon as the rank is gone, however it went (torch's own watchdog watches the worker's parent, which for
    a worker of the fork server is the server: a rank killed outright left the server and its workers running for
    good, each keeping the other alive)."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    rank = multiprocessing.parent_process()
    if rank is not None:
        threading.Thread(target=_leave_with, args=(rank.sentinel,), name="leave-with-the-rank", daemon=True).start()


def _leave_with(rank_sentinel: int) -> None:
    multiprocessing.connection.wait([rank_sentinel])
    os._exit(0)


@atexit.register  # after multiprocessing.util's own (imported above): atexit runs the last registered first
def _end_workers_left() -> None:
    """A rank that leaves through the interpreter's exit (a run that raised with a loader open) has multiprocessing
    SIGTERM its daemonic children, the loaders' workers among them, and wait for them without end: they ignore
    SIGTERM (STOP_SIGNALS). They are killed first; other children are left to multiprocessing."""
    for worker in list(_WORKERS):
        if worker.is_alive():
            worker.kill()


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

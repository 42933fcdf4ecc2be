"""How a loader's DataLoader workers start, and end with their rank.

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
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401 - its exit function registered before this module's (_end_workers_left)
import os
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader

from distsetup.errors import first_line

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # the rank's to answer (training/preemption.py)
QUEUE_FEEDER_WAIT_S = 5.0  # a closed queue's thread ends at once; a rank never waits long on a stuck one


def started(loader: Callable[[str], DataLoader], device: torch.device, rank: int) -> Iterator:
    """The batches of `loader(start_method)`, a DataLoader with workers (its worker_init_fn: serve_the_rank), its
    workers started from the fork server where forking can deadlock, else forked; `rank` 0 says why where the
    server's workers cannot be given the dataset."""
    if _forking_can_deadlock(device):
        _without_torchs_pickling_advice()
        try:
            return _kept(iter(loader(_fork_server())))
        except Exception as e:  # whatever stops the server's workers (pickling, too many file descriptors)
            if rank == 0:
                _note_forked_from_the_rank(f"{type(e).__name__}: {first_line(e)}")
    with _stop_signals_blocked():  # the forked workers keep them blocked
        return _kept(iter(loader("fork")))


# torch's words for a pickling error, which suggest fork for everything (the workers are forked then, with a note)
PICKLING_ADVICE = "Got pickle error when attempting to start a worker"


def _without_torchs_pickling_advice() -> None:
    """PICKLING_ADVICE left out, the warning filters changed only where they lack it: each change clears Python's
    record of the warnings said once, and a change at each loader's start (an evaluation's) had each said again
    (FSDP2's of a view)."""
    if not any(
        action == "ignore" and message is not None and message.pattern == PICKLING_ADVICE
        for action, message, *_ in warnings.filters
    ):
        warnings.filterwarnings("ignore", PICKLING_ADVICE)


def shut_down(batches: Iterator) -> None:
    """Stop the workers of `batches` (a DataLoader's iterator), also where an exception's traceback still holds it,
    and wait for the threads that fed the loaders' closed queues to end: they hold the queues' semaphores, which the
    fork server's resource tracker would otherwise find left behind, and warn of, once the rank has left without the
    interpreter's teardown (distsetup/train.py exit_now)."""
    getattr(batches, "_shutdown_workers", lambda: None)()  # torch's, as when the iterator is freed
    for queue in list(_INDEX_QUEUES):
        feeder = getattr(queue, "_thread", None)  # multiprocessing.Queue's, ending once the queue is closed
        if feeder is not None and getattr(queue, "_closed", False):  # not another live loader's
            feeder.join(timeout=QUEUE_FEEDER_WAIT_S)


# The loaders' worker processes and the queues this rank feeds them indices through, while they exist
_WORKERS: "weakref.WeakSet[multiprocessing.process.BaseProcess]" = weakref.WeakSet()
_INDEX_QUEUES: weakref.WeakSet = weakref.WeakSet()


def _kept(batches: Iterator) -> Iterator:
    """`batches`, a DataLoader's iterator with workers, its workers and index queues kept in _WORKERS and
    _INDEX_QUEUES (torch's attributes; none where torch has other names for them)."""
    _WORKERS.update(getattr(batches, "_workers", ()))
    _INDEX_QUEUES.update(getattr(batches, "_index_queues", ()))
    return batches


def _forking_can_deadlock(device: torch.device) -> bool:
    """Whether a worker forked from the rank can deadlock: under CPython 3.11 and older, where the rank's gradients
    go through gloo, whose threads enter Python (see the module's docstring)."""
    return sys.version_info < (3, 12) and device.type == "cpu"


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
        "from the rank, which can deadlock under CPython 3.11 (see distsetup/training/data/worker_processes.py); "
        "make it picklable (no lambdas, open files or locally defined classes in it) and hold fewer than 240 tensors.",
        flush=True,
    )


def serve_the_rank(worker_id: int) -> None:
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

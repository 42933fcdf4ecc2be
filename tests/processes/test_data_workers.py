"""data.num_workers: on the CPU under CPython 3.11 the DataLoader workers start from a fork server, not forked from
the rank (CPython 3.11 can deadlock a child forked while gloo's threads enter Python), and they go when the rank is
killed outright; the signals that stop a run (a launcher's or SLURM's, sent to every process of the rank) leave them
serving the rank until it ends them. A dataset the server's workers cannot be given is forked from the rank, with
one note. The runs behind it: test_train_resume.py (SIGTERM to torchrun, SIGUSR1 and SIGINT to every process of a
run) and test_own_model.py (the pairwise scorer's 2 workers)."""

import os
import select
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from process_tree import process_tree, running
from torch.utils.data import default_collate

from distsetup.errors import DistsetupError
from distsetup.training.data.datasets import ShardedSampler
from distsetup.training.data.loader import Placement, StepLoader, validation_batches
from distsetup.training.data.worker_processes import STOP_SIGNALS, _note_forked_from_the_rank

CPU = Placement(torch.device("cpu"))


class WhoServes:
    """Each sample: the pid of the process that read it, and of its parent."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([os.getpid(), os.getppid()])


class WhoServesFromAnOpenFile(WhoServes):
    def __init__(self):
        self.log = open(os.devnull, "w")  # an open file cannot be pickled


class WhoServesBesideManyTensors(WhoServes):
    def __init__(self, n: int = 247):  # 246 and 247 ended the server (Linux refused the message), 300 did not
        self.rows = [torch.zeros(2) for _ in range(n)]  # a file descriptor each, 253 at most to a message


FROM_A_FORK_SERVER = sys.version_info < (3, 12)  # on the CPU (these tests'); CPython 3.12 forks safely


def servers(batches: list[torch.Tensor]) -> tuple[set[int], set[int]]:
    """(the workers' pids, their parents' pids) in `batches`."""
    rows = torch.cat(batches)
    return set(rows[:, 0].tolist()), set(rows[:, 1].tolist())


def read_through_stop_signals(dataset) -> tuple[set[int], set[int]]:
    """Two steps of 2 micro-batches from 2 workers, every stop signal sent to them and their parent in between (the
    test's own process, where they were forked from it, is left out), then two steps more."""
    loader = StepLoader(dataset, ShardedSampler(8, 2, 2, 1, 0, 0), default_collate, 2, CPU)
    try:
        before = [batch for _ in range(2) for batch in loader.next_step()]
        workers, parents = servers(before)
        for pid in workers | parents - {os.getpid()}:
            for stop in STOP_SIGNALS:
                os.kill(pid, stop)
        after = [batch for _ in range(2) for batch in loader.next_step()]
    finally:
        loader.close()
    assert servers(after) == (workers, parents)  # the same workers, alive and serving
    return workers, parents


def say_a_warning() -> None:
    warnings.warn("a warning Python says once from here", UserWarning, stacklevel=1)


def test_workers_start_where_they_cannot_deadlock_and_serve_through_the_stop_signals(capsys):
    """And a warning said once is not said again at the next loaders' start (each evaluation's): the loaders left
    Python's warning filters as they were (FSDP2's warning of a view came back after every evaluation)."""
    with warnings.catch_warnings(record=True) as said:
        workers, parents = read_through_stop_signals(WhoServes())
        say_a_warning()
        for _ in range(2):
            assert len(list(validation_batches(WhoServes(), 2, 0, 1, default_collate, 2, CPU))) == 4
            say_a_warning()
    assert len(workers) == 2 and os.getpid() not in workers and len(parents) == 1
    assert (os.getpid() not in parents) == FROM_A_FORK_SERVER
    assert "note:" not in capsys.readouterr().out
    assert [str(w.message) for w in said].count("a warning Python says once from here") == 1


@pytest.mark.parametrize(
    "dataset, why", [(WhoServesFromAnOpenFile, "TextIOWrapper"), (WhoServesBesideManyTensors, "too many fds")]
)
def test_a_dataset_the_fork_servers_workers_cannot_take_is_read_by_workers_forked_from_the_rank(capsys, dataset, why):
    """Meanwhile another loader's workers from the server serve on (246 and 247 tensors ended the server)."""
    _note_forked_from_the_rank.cache_clear()  # said once a process: here once a test
    other = StepLoader(WhoServes(), ShardedSampler(8, 2, 2, 1, 0, 0), default_collate, 2, CPU)
    try:
        data = dataset()
        workers, parents = read_through_stop_signals(data)
        assert len(workers) == 2 and parents == {os.getpid()}
        for _ in range(2):  # as at two evaluations: said once
            assert len(list(validation_batches(data, 2, 0, 1, default_collate, 2, CPU))) == 4
        assert len(servers([batch for _ in range(3) for batch in other.next_step()])[0]) == 2
    finally:
        other.close()
    said = capsys.readouterr().out
    assert said.count("note: data.num_workers: the dataset cannot go to workers of the fork server") == int(
        FROM_A_FORK_SERVER
    ), said
    assert (why in said) == FROM_A_FORK_SERVER and "pickle error" not in said  # the reason, not torch's warning


class OneImageOfAnotherSize(WhoServes):
    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(3, 6 if index == 5 else 4, 4)  # as a folder of real images has one


class Unreadable(WhoServes):
    def __getitem__(self, index: int) -> torch.Tensor:
        raise FileNotFoundError(f"images/{index}.png")


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_that_make_no_batch_are_said_in_one_line(workers):
    """Bug: a DataLoader's traceback (and a worker's inside it), 60 lines, where the model's and the loss's errors
    of the first batch are one line."""
    for dataset, said in (
        (
            OneImageOfAnotherSize(),
            "the samples of a micro-batch do not make a batch by default_collate: RuntimeError: stack expects each "
            "tensor to be equal size",
        ),
        (Unreadable(), "data.builder's dataset raised FileNotFoundError: images/"),
    ):
        loader = StepLoader(dataset, ShardedSampler(8, 4, 1, 2, 1, 0), default_collate, workers, CPU, "default_collate")
        try:
            with pytest.raises(DistsetupError) as refused:
                loader.next_step()
        finally:
            loader.close()
        assert said in refused.value.problem and "\n" not in str(refused.value), str(refused.value)
        if workers == 0:  # evaluation's batches go the same way (its workers start as training's)
            batches = validation_batches(dataset, 4, 1, 2, default_collate, workers, CPU, "default_collate")
            with pytest.raises(DistsetupError, match=said.replace("(", r"\(").replace(")", r"\)")):
                list(batches)


RANK = """
import os, sys, time
sys.path[:0] = {paths!r}  # this module's folder, and tests/support
import torch
from torch.utils.data import default_collate
from distsetup.errors import DistsetupError
from distsetup.training.data.datasets import ShardedSampler
from distsetup.training.data.loader import Placement, StepLoader
from test_data_workers import WhoServes

if __name__ == "__main__":
    cpu = Placement(torch.device("cpu"))
    loader = StepLoader(WhoServes(), ShardedSampler(8, 2, 2, 1, 0, 0), default_collate, 2, cpu)  # 2 micro-batches
    print(*torch.cat(loader.next_step())[:, 0].tolist(), flush=True)
    time.sleep(1)  # long enough to look at its processes
    if sys.argv[1] == "raising":
        raise RuntimeError("a run that fails with its loader open")
    time.sleep(600)  # until killed
"""


@pytest.mark.parametrize("end", ["killed outright", "raising"])
def test_a_rank_that_ends_takes_its_workers_with_it(tmp_path, end):
    """kill -9 of a rank (a lost node, the OOM killer): its workers and the fork server they came from end within
    seconds (the server's children kept it alive, and torch's watchdog watched the server). A rank that raises with
    its loader open leaves (multiprocessing's exit SIGTERMed the workers, which ignore it, and waited for good)."""
    script = tmp_path / "rank.py"
    here = Path(__file__).parent
    script.write_text(RANK.format(paths=[str(here), str(here.parent / "support")]))
    rank = subprocess.Popen(
        [sys.executable, str(script), end], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    tree = {rank.pid}
    try:
        ready, _, _ = select.select([rank.stdout], [], [], 120)
        workers = {int(pid) for pid in rank.stdout.readline().split()} if ready else set()
        tree = set(process_tree(rank.pid))
        assert len(workers) == 2 and workers < tree, (workers, tree, rank.poll() is not None and rank.stderr.read())
        if end == "killed outright":
            rank.kill()
        _, said = rank.communicate(timeout=60)  # once every process holding its output has ended
        assert end == "killed outright" or "a run that fails with its loader open" in said
        deadline = time.monotonic() + 20
        while (left := running(tree - {rank.pid})) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, left
    finally:
        for pid in running(tree):
            os.kill(pid, signal.SIGKILL)

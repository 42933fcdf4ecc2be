"""data.num_workers: the DataLoader workers start from a fork server, never forked from the rank (CPython 3.11 can
deadlock a child forked from a process with threads), and the signals that stop a run (a launcher's or SLURM's, sent
to every process of the rank) leave them serving the rank until it ends them. A dataset that cannot be pickled to
the server is forked from the rank, with one note. The runs behind it: test_train_resume.py (SIGTERM to torchrun,
SIGUSR1 and SIGINT to every process of a run) and test_own_model.py (the pairwise scorer's 2 workers)."""

import os

import torch
from torch.utils.data import default_collate

from distsetup.training.data.datasets import ShardedSampler
from distsetup.training.data.loader import STOP_SIGNALS, Placement, StepLoader, validation_batches

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


def test_workers_start_from_a_fork_server_and_serve_through_the_stop_signals(capsys):
    workers, parents = read_through_stop_signals(WhoServes())
    assert len(workers) == 2 and os.getpid() not in workers | parents and len(parents) == 1
    assert "note:" not in capsys.readouterr().out


def test_a_dataset_that_cannot_be_pickled_is_read_by_workers_forked_from_the_rank_with_one_note(capsys):
    dataset = WhoServesFromAnOpenFile()
    workers, parents = read_through_stop_signals(dataset)
    assert len(workers) == 2 and parents == {os.getpid()}
    for _ in range(2):  # as at two evaluations: said once
        assert len(list(validation_batches(dataset, 2, 0, 1, default_collate, 2, CPU))) == 4
    said = capsys.readouterr().out
    assert said.count("note: data.num_workers: the dataset cannot be pickled") == 1, said
    assert "TextIOWrapper" in said and "pickle error" not in said  # the reason, once; not torch's own warning

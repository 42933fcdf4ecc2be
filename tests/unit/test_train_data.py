"""The order ranks read samples in (the ShardedSampler), without processes; and a data file found next to its config."""

import json

import pytest
import torch

from distsetup.training.data.datasets import ShardedSampler

N, MICRO, ACC, SEED = 40, 3, 2, 11  # global batch 3 x 2 x 2 = 12: 3 steps per epoch, 4 samples never drawn


def run(sampler, steps):
    return [torch.cat(sampler.next_step()).tolist() for _ in range(steps)]


def test_ranks_read_disjoint_samples_whose_union_is_the_single_process_batch():
    ranks = [run(ShardedSampler(N, MICRO, ACC, 2, r, SEED), 7) for r in range(2)]
    single = run(ShardedSampler(N, MICRO, ACC * 2, 1, 0, SEED), 7)
    for step in range(7):  # across two epoch boundaries
        a, b = ranks[0][step], ranks[1][step]
        assert len(a) == len(b) == MICRO * ACC and not set(a) & set(b)
        assert sorted(a + b) == sorted(single[step])


def test_each_epoch_is_a_fresh_permutation():
    sampler = ShardedSampler(N, MICRO, ACC, 1, 0, SEED)
    per_epoch = N // (MICRO * ACC)
    epochs = [sum(run(sampler, per_epoch), []) for _ in range(3)]
    for order in epochs:
        assert len(order) == len(set(order)) == per_epoch * MICRO * ACC  # no sample twice within an epoch
        assert all(0 <= i < N for i in order)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert sampler.state_dict()["epoch"] == 2


@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])  # mid-epoch, at an epoch's end, past it
def test_resume_mid_run_continues_the_same_order(stop_after):
    uninterrupted = run(ShardedSampler(N, MICRO, ACC, 2, 1, SEED), 9)
    first = ShardedSampler(N, MICRO, ACC, 2, 1, SEED)
    head = run(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # as it travels in the COMPLETE marker
    second = ShardedSampler(N, MICRO, ACC, 2, 1, SEED)
    second.load_state_dict(state)
    assert head + run(second, 9 - stop_after) == uninterrupted


def global_batches(samplers, steps):
    """The samples the ranks of one run read together at each step, as a set per step."""
    per_rank = [run(sampler, steps) for sampler in samplers]
    return [set(sum((rank[step] for rank in per_rank), [])) for step in range(steps)]


def resumed_at(state, micro, acc, world):
    samplers = [ShardedSampler(N, micro, acc, world, rank, SEED) for rank in range(world)]
    for sampler in samplers:
        sampler.load_state_dict(state)
    return samplers


@pytest.mark.parametrize("micro, acc, world", [(2, 2, 3), (6, 2, 1), (1, 4, 3), (12, 1, 1)])
def test_the_same_global_batch_split_otherwise_reads_what_the_uninterrupted_run_reads(micro, acc, world):
    uninterrupted = global_batches([ShardedSampler(N, MICRO, ACC, 2, r, SEED) for r in range(2)], 8)
    first = [ShardedSampler(N, MICRO, ACC, 2, r, SEED) for r in range(2)]
    head = global_batches(first, 2)
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["samples"] == 2 * MICRO * ACC * 2
    assert head + global_batches(resumed_at(state, micro, acc, world), 6) == uninterrupted


def test_another_global_batch_continues_from_the_same_sample():
    first = ShardedSampler(N, MICRO, ACC, 2, 0, SEED)
    run(first, 2)  # 24 of the 40 samples of epoch 0
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    (bigger,) = resumed_at(first.state_dict(), 8, 1, 1)
    next_epoch = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + 1)).tolist()
    assert run(bigger, 3) == [order[24:32], order[32:40], next_epoch[:8]]


def test_a_position_stored_in_steps_is_read_as_samples():
    """Checkpoints written before the position was counted in samples stored optimizer steps."""
    (resumed,) = resumed_at({"epoch": 0, "position": 2, "global_batch": 12}, 12, 1, 1)
    assert resumed.state_dict() == {"epoch": 0, "samples": 24, "global_batch": 12}


def test_data_files_are_found_next_to_the_config_from_any_folder(tmp_path):
    """A relative data path resolves as validation resolves it: the working folder, else next to the config."""
    from train_runs import train, write_config

    (tmp_path / "corpus.txt").write_text("distsetup reads text files byte by byte. " * 40)
    config = write_config(
        tmp_path,
        "single",
        "single",
        None,
        {"max_steps": 2, "micro_batch_size": 4, "checkpoint_interval": 2},
        data={"type": "files", "paths": ["corpus.txt"]},
    )
    result = train(config, 1)  # from the repository's folder, where no corpus.txt is
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 2

"""The data side of src/train.py without processes: text files as samples and the ShardedSampler's order."""

import json

import pytest
import torch

from distsetup.errors import DistsetupError
from distsetup.training.data import ShardedSampler, file_dataset

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
    per_epoch = sampler.steps_per_epoch
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


def test_resume_with_another_global_batch_is_an_error():
    state = ShardedSampler(N, MICRO, ACC, 2, 0, SEED).state_dict()
    with pytest.raises(DistsetupError, match="global batch 12"):
        ShardedSampler(N, MICRO, ACC, 1, 0, SEED).load_state_dict(state)


def test_text_and_jsonl_files_become_byte_samples(tmp_path):
    (tmp_path / "a.txt").write_text("héllo world " * 10)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "line one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    data = file_dataset([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], 15, 256)
    expected = ("héllo world " * 10 + "\nline one\ntwo").encode()
    assert data.shape == (len(expected) // 16, 16)
    assert bytes(data.flatten().tolist()) == expected[: data.numel()]


def test_jsonl_without_text_field_names_the_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DistsetupError, match="bad.jsonl:2"):
        file_dataset([str(tmp_path / "bad.jsonl")], 4, 256)


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

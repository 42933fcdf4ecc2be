"""A model this node cannot hold is refused before any process group, in one line (issue 37): the processes that
build it whole (rank 0 alone where the others build it on the meta device) and, on a CPU, every process's training
state, counted as `distsetup plan` counts it."""

import pytest
from train_runs import assert_clean_error, train, write_run_config

from distsetup.errors import DistsetupError
from distsetup.training import memory
from distsetup.training.launch_env import World
from distsetup.training.model import build

P = 10**9
EIGHT = World(rank=0, local_rank=0, size=8, local_size=8)


def test_each_rank_holds_its_share_of_the_state():
    assert build.training_state_bytes("ddp", P, EIGHT, "fp32") == 16 * P  # weights, gradients, AdamW's two moments
    assert build.training_state_bytes("fsdp_full_shard", P, EIGHT, "fp32") == 16 * P / 8
    # DeepSpeed's fp32 gradient partition comes on top of ZeRO-3's share; training in fp32 its master is the
    # partition itself (zero3_master_weights), where ZeRO-2 keeps a copy
    assert build.training_state_bytes("zero3", P, EIGHT, "fp32") == 20 * P / 8
    assert build.training_state_bytes("zero2", P, EIGHT, "fp32") == 4 * P + 4 * P / 8 + 16 * P / 8
    two_nodes = World(rank=0, local_rank=0, size=16, local_size=8)
    assert build.training_state_bytes("fsdp_full_shard", P, two_nodes, "fp32") == 16 * P / 16


def test_rank_0_s_whole_copy_and_the_shards_are_what_must_fit(monkeypatch):
    sharded = build.training_state_bytes("fsdp_full_shard", P, EIGHT, "fp32")
    monkeypatch.setattr(memory, "available_memory", lambda: 4 * P + 8 * sharded)
    build.check_model_fits(P, 1, "model.n_embd", holders=8, state_bytes=sharded)  # exactly fits
    with pytest.raises(DistsetupError) as refused:
        build.check_model_fits(P, 8, "model.n_embd", holders=8, state_bytes=sharded)  # every rank builds it whole
    assert "8 process(es) building it whole" in str(refused.value)


def test_a_run_whose_state_no_machine_here_holds_is_refused_before_the_process_group(tmp_path):
    """2e9 parameters under DDP on 8 local processes: 8 x 16 bytes a parameter of state (256 GB) and 8 whole
    builds; said once, naming the sizes to lower and the sharded backends."""
    config = write_run_config(tmp_path, "ddp")
    world = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0"}
    big = ["model.n_embd=4096", "model.n_head=32", "model.n_layer=10"]
    result = train(config, 1, *big, env=world, timeout=120)
    line = assert_clean_error(result, "8 training it on the CPU", "model.n_embd", "FSDP2, ZeRO-3")
    assert "2,0" in line and "GiB of state each" in line
    assert not (tmp_path / "out").exists()

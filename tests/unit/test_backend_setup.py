"""Backends as they set themselves up, in one process: FSDP's size-based wrap units and its 2-D mesh for hybrid
sharding, DeepSpeed's file lr, used as written, and the built-in model's block class they shard by name."""

import json

import pytest
import torch
from train_runs import MODEL, ds_file


def test_size_based_wrap_takes_modules_with_enough_parameters_and_skips_containers():
    from distsetup.training.backends.fsdp import _size_based_units
    from distsetup.training.model.gpt import GPT

    model = GPT(256, MODEL["block_size"], MODEL["n_layer"], MODEL["n_head"], MODEL["n_embd"], 0.0)
    units = _size_based_units(model, 5000)  # h = 32: an MLP has 8352, attention 4224, wte/lm_head 8192
    assert sorted(type(u).__name__ for u in units) == ["Embedding", "Linear", "MLP", "MLP"]
    assert model.blocks not in units  # a ModuleList has no forward: FSDP would never gather it
    assert all(sum(p.numel() for p in u.parameters()) >= 5000 for u in units)


def test_size_based_wrap_leaves_a_tied_weight_to_the_unit_around_both_holders():
    """A head tied to the embedding was made a unit of its own (the last module, taken first), its weight then in
    two units, which FSDP2 refuses ("shared with a parameter already managed by another FSDP group")."""
    from tied_model import TiedLM

    from distsetup.training.backends.fsdp import _size_based_units

    model = TiedLM(vocab=64, width=16, layers=2)  # embed and head share 1024 parameters; a block holds 304
    units = _size_based_units(model, 300)
    assert model.head not in units and model.embed not in units
    assert units == [model.blocks[1], model.blocks[0]]


@pytest.mark.parametrize(
    "strategy, world, local, shape",
    [
        ("HYBRID_SHARD", 2, 1, (2, 1)),
        ("HYBRID_SHARD", 2, 2, (1, 2)),
        ("HYBRID_SHARD_ZERO2", 8, 4, (2, 4)),
        ("NO_SHARD", 4, 2, (4, 1)),
        ("FULL_SHARD", 4, 2, (4,)),
    ],
)
def test_mesh_shape_follows_processes_per_node(strategy, world, local, shape):
    from distsetup.training.backends.fsdp import mesh_shape

    assert mesh_shape(strategy, world, local) == shape


def test_hybrid_shard_needs_equal_nodes():
    from distsetup.errors import DistsetupError
    from distsetup.training.backends.fsdp import mesh_shape

    with pytest.raises(DistsetupError, match="multiple of the processes per node"):
        mesh_shape("HYBRID_SHARD", 3, 2)


def test_deepspeed_file_lr_is_used_as_written_even_with_training_scale_lr(tmp_path):
    """`distsetup deepspeed --scale_lr` scales the file's lr; the trainer scaled it a second time."""
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends.deepspeed import DeepSpeedBackend
    from distsetup.training.launch_env import World

    ds = {**ds_file(1), "optimizer": {"type": "AdamW", "params": {"lr": 0.004}}}  # batch 16 = 8 x 1 x 2
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = load_run_config(
        None,
        [
            "distributed.backend=deepspeed",
            f"distributed.deepspeed_config={tmp_path / 'ds.json'}",
            "training.scale_lr=linear",
            "training.base_batch_size=4",
        ],
    )
    backend = DeepSpeedBackend(cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device("cpu"))
    assert backend.lr == 0.004 and backend.ds_config["optimizer"]["params"]["lr"] == 0.004
    assert any("training.scale_lr linear not applied" in note for note in backend.notes), backend.notes


def test_the_built_in_models_block_is_the_class_its_constant_names():
    """formats.runconfig.BUILTIN_BLOCK is what FSDP's files, the planner and the trainer name the GPT's block by."""
    from distsetup.formats.runconfig import BUILTIN_BLOCK
    from distsetup.training.model.gpt import GPT

    assert {type(block).__name__ for block in GPT(64, 16, 2, 2, 16, 0.0).blocks} == {BUILTIN_BLOCK}


def test_ddp_broadcasts_buffers_only_where_training_may_change_them():
    """Rank 0's buffers are broadcast before each forward only where they can drift apart: running statistics, or
    the user's own module; the built-in GPT's causal mask is a constant every rank builds alike."""
    from distsetup.training.backends.rank0_buffers import buffers_may_change
    from distsetup.training.model.gpt import GPT

    gpt = GPT(64, 16, 2, 2, 16, 0.0)
    assert not buffers_may_change(gpt, "gpt")
    assert not buffers_may_change(gpt, "hf")
    assert buffers_may_change(gpt, "python")
    normed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert buffers_may_change(normed, "hf") and buffers_may_change(normed, "gpt")
    assert not buffers_may_change(torch.nn.Sequential(torch.nn.BatchNorm1d(4, track_running_stats=False)), "gpt")


def test_the_single_backend_refuses_a_world_of_several_in_one_line():
    from distsetup.errors import DistsetupError
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends import make_backend
    from distsetup.training.launch_env import World

    cfg = load_run_config(None, ["distributed.backend=single"])
    alone = make_backend("single", cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
    assert not alone.needs_process_group
    several = "distributed.backend: single trains one process, .* world has 2"
    with pytest.raises(DistsetupError, match=several) as refused:
        make_backend("single", cfg, World(rank=0, local_rank=0, size=2, local_size=2), torch.device("cpu"))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_only_zero3_says_that_its_gathers_may_wait_for_each_other(tmp_path, stage):
    """The lost-contact line's hint: ZeRO-3 gathers each module's parameters in forward, so a model that runs other
    modules on each rank without a named leaf can leave ranks waiting; a model whose such layers are known (the
    trainer makes them leaves) and the other stages cannot."""
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends import make_backend
    from distsetup.training.launch_env import World

    (tmp_path / "ds.json").write_text(json.dumps({**ds_file(1), "zero_optimization": {"stage": stage}}))
    run = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'ds.json'}"]
    world = World(rank=0, local_rank=0, size=2, local_size=2)
    backend = make_backend("deepspeed", load_run_config(None, run), world, torch.device("cpu"))
    hint = backend.hang_hint(conditional=False)
    assert (hint is not None and "model.zero3_leaf_classes" in hint) == (stage == 3)
    assert backend.hang_hint(conditional=True) is None
    ddp = make_backend("ddp", load_run_config(None, ["distributed.backend=ddp"]), world, torch.device("cpu"))
    assert ddp.hang_hint(conditional=False) is None and ddp.needs_process_group

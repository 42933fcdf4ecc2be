"""FSDP2 as the trainer shards a model: between a training forward and its backward, every unit but the one that
runs last holds its parameters sharded; that last unit (torchtitan's policy) and the root (embeddings and head,
which backward gathers at its start) stay gathered; a SHARD_GRAD_OP file keeps every unit gathered. One process in
a gloo group: a sharded parameter is a DTensor, a gathered one a plain tensor."""

import json

import pytest
import torch
import torch.nn.functional as F
from repo import free_port
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distsetup.formats.fsdp import FsdpSpec, build_fsdp_config
from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.backends.fsdp import FSDPBackend
from distsetup.training.launch_env import World
from distsetup.training.model import build as models

TINY = ["model.n_layer=3", "model.n_embd=32", "model.block_size=16", "model.vocab_size=512"]
WRAPPING = {  # FsdpSpec's fields changed from distsetup fsdp's defaults (full shard of each block)
    "by layer class": ({}, ["blocks.2", "root"]),
    # children first: each MLP (8352 parameters) is a unit, then what remains of each block, then the embedding
    # and the head; the head runs last, though the size-based policy lists it first
    "by size": (
        {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 5000},
        ["lm_head", "root"],
    ),
    "SHARD_GRAD_OP": ({"sharding_strategy": "SHARD_GRAD_OP"}, "every unit"),
}


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def units_gathered_between_forward_and_backward(
    tmp_path, fsdp: dict, classes: tuple[str, ...] = ("Block",), more: tuple[str, ...] = ()
) -> tuple[list[str], list[str], list[str]]:
    """(every FSDP unit's name, those whose parameters are gathered after a training forward, the backend's notes)."""
    (tmp_path / "fsdp.json").write_text(
        json.dumps(build_fsdp_config(FsdpSpec(transformer_layer_cls_to_wrap=classes, **fsdp)))
    )
    cfg = load_run_config(
        None, [*TINY, "distributed.backend=fsdp", f"distributed.fsdp_config={tmp_path / 'fsdp.json'}", *more]
    )
    backend = FSDPBackend(cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
    model = models.build(cfg.model)
    backend.wrap(models.parts(model, cfg.model, ["Block"]), cfg.training.max_steps)
    units = {name or "root": m for name, m in backend.model.named_modules() if isinstance(m, FSDPModule)}
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    loss = F.cross_entropy(backend.model(x).flatten(0, 1), x.flatten())
    gathered = [name for name, unit in units.items() if not any(isinstance(p, DTensor) for p in own(unit, units))]
    loss.backward()
    return sorted(units), sorted(gathered), backend.notes


def own(unit, units: dict) -> list:
    """The parameters `unit` shards itself (not those of a unit inside it)."""
    inside = [other for other in units.values() if other is not unit and any(other is m for m in unit.modules())]
    theirs = {id(p) for other in inside for p in other.parameters()}
    return [p for p in unit.parameters() if id(p) not in theirs]


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # the MLP unit's output is a view; the block adds to it
@pytest.mark.parametrize("wrapping", sorted(WRAPPING))
def test_only_the_last_unit_and_the_root_stay_gathered_for_backward(tmp_path, wrapping):
    fsdp, expected = WRAPPING[wrapping]
    units, gathered, notes = units_gathered_between_forward_and_backward(tmp_path, fsdp)
    assert len(units) >= 4, units
    assert not [note for note in notes if note.startswith("FSDP units")]  # the file's classes are the blocks'
    assert gathered == (units if expected == "every unit" else expected), units


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_a_unit_class_inside_another_is_sharded_first(tmp_path):
    """Block holds an MLP: naming both shards each MLP, then what is left of its block (FSDP2 shards bottom up; the
    block first took the MLP's parameters, and fully_shard refused the MLP: "Cannot concatenate overlapping meshes")."""
    units, gathered, notes = units_gathered_between_forward_and_backward(tmp_path, {}, ("Block", "MLP"))
    assert not [note for note in notes if note.startswith("FSDP units")]  # nothing takes the blocks: nothing said
    assert {"blocks.0", "blocks.0.mlp", "blocks.2", "blocks.2.mlp"} <= set(units), units
    assert {"blocks.2", "blocks.2.mlp"} <= set(gathered)  # the last block stays gathered for backward, its MLP too
    assert "blocks.1.mlp" not in gathered


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_units_other_than_the_blocks_that_recomputing_takes_are_said(tmp_path):
    """distsetup fsdp writes Block by default: a file naming other classes made other units than model.layer_classes
    (what activation checkpointing and compile take), without a word."""
    *_, notes = units_gathered_between_forward_and_backward(
        tmp_path, {}, ("Block", "MLP"), ("training.activation_checkpointing=full",)
    )
    said = "FSDP units: the FSDP file's fsdp_transformer_layer_cls_to_wrap (Block, MLP), not the model's blocks (Block)"
    assert [note for note in notes if note.startswith("FSDP units")] == [
        f"{said}, which activation checkpointing and compile take"
    ]


def test_an_optimizer_folder_without_some_settings_loads_with_this_runs_own(tmp_path):
    """A folder `checkpoint convert` wrote from a ZeRO run on DeepSpeed's Adam holds no amsgrad, foreach, ...: dcp.load
    refused it ("Missing key in checkpoint state_dict: param_groups.0.amsgrad"); the saved settings load, the
    missing ones stay this optimizer's."""
    import torch.distributed.checkpoint as dcp

    from distsetup.training.backends.fsdp import load_keeping_own_settings

    saved = {
        "state": {"w": {"exp_avg": torch.ones(3)}},
        "param_groups": [{"lr": 0.5, "betas": (0.8, 0.9), "params": ["w"]}],
    }
    dcp.save(saved, checkpoint_id=tmp_path / "optim")
    own = {"state": {"w": {"exp_avg": torch.zeros(3)}}}
    own["param_groups"] = [{"lr": 0.1, "betas": (0.9, 0.95), "amsgrad": False, "fused": True, "params": ["w"]}]
    load_keeping_own_settings(own, tmp_path / "optim")
    assert own["param_groups"][0] == {"lr": 0.5, "betas": (0.8, 0.9), "amsgrad": False, "fused": True, "params": ["w"]}
    assert torch.equal(own["state"]["w"]["exp_avg"], torch.ones(3))

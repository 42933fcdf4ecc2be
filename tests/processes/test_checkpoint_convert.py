"""`distsetup checkpoint convert`: a checkpoint rewritten offline for another backend is resumed by it as its own,
at another world size, and continues the uninterrupted run's loss curve; the source is only read; bad requests are
one line that writes nothing."""

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from train_runs import (
    DS_FILES,
    INTERVAL,
    RUNS,
    STEPS,
    TRAINING,
    ds_split,
    final_weights,
    losses,
    shared_run,
    train,
    write_config,
)

from distsetup.cli.main import cli
from distsetup.formats.checkpoint_folder import MARKER, file_sizes, step_dir
from distsetup.training.checkpoint.export import consolidated_state_dict

# case -> (source run, --to, processes resuming it, their backend file, micro-batch, accumulation)
CONVERSIONS = {
    "zero3 2 -> fsdp 2": ("zero3", "fsdp", 2, lambda: RUNS["fsdp_full"][2], 12, 1),
    "ddp 2 -> deepspeed, zero1 micro 4 x 3": ("ddp", "deepspeed", 2, lambda: ds_split("zero1", 2, 4), 4, 3),
}


def killed_at_interval(tmp_path, source: str):
    """A run folder holding step 10 of the shared run `source`: what a job killed after step 10 leaves."""
    run = tmp_path / "source"
    shutil.copytree(step_dir(shared_run(source) / "checkpoints", INTERVAL), step_dir(run / "checkpoints", INTERVAL))
    return run


def convert(*args):
    return CliRunner().invoke(cli, ["checkpoint", "convert", *map(str, args)])


@pytest.mark.parametrize("case", CONVERSIONS)
def test_a_converted_checkpoint_resumes_under_its_new_backend(tmp_path, case):
    source, to, processes, backend_file, micro, accumulation = CONVERSIONS[case]
    run = killed_at_interval(tmp_path, source)
    before = file_sizes(run)
    result = convert(run, "--to", to, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert file_sizes(run) == before  # the source is only read
    converted = step_dir(tmp_path / "out" / "checkpoints", INTERVAL)
    marker = json.loads((converted / MARKER).read_text())
    assert marker["backend"] == to and marker["converted_from"].startswith(RUNS[source][1])
    assert marker["sampler"] == json.loads((step_dir(run / "checkpoints", INTERVAL) / MARKER).read_text())["sampler"]
    source_weights = consolidated_state_dict(step_dir(run / "checkpoints", INTERVAL))
    converted_weights = consolidated_state_dict(converted)  # `checkpoint export` reads the converted layout too
    assert converted_weights.keys() == source_weights.keys()
    assert all(torch_equal(converted_weights[k], v) for k, v in source_weights.items())

    training = {**TRAINING, "micro_batch_size": micro, "gradient_accumulation_steps": accumulation}
    config = write_config(tmp_path, source, to, backend_file(), training)
    resumed_run = train(config, processes)  # training.output_dir: tmp_path/out, the converted folder
    assert resumed_run.returncode == 0, resumed_run.stdout[-3000:] + resumed_run.stderr[-3000:]
    assert re.search(rf"resumed from \S+step_{INTERVAL:07d} \(step {INTERVAL}\)", resumed_run.stdout)
    assert "converted for this run" not in resumed_run.stdout  # the new backend loads it as its own
    assert "MPU is not provided" not in resumed_run.stdout + resumed_run.stderr  # DeepSpeed's, per rank: no TP here
    resumed, uninterrupted = losses(tmp_path / "out"), losses(shared_run(source))[INTERVAL:]
    assert len(resumed) == STEPS - INTERVAL >= 20
    assert resumed == pytest.approx(uninterrupted, rel=1e-4)
    weights, reference = final_weights(tmp_path / "out"), final_weights(shared_run(source))
    # qkv biases aside: see test_resume_elsewhere
    drift = {k: float((weights[k] - v).norm() / v.norm()) for k, v in reference.items() if "qkv.bias" not in k}
    assert max(drift.values()) < 1e-4, sorted(drift.items(), key=lambda kv: -kv[1])[:3]


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def same(a, b) -> bool:
    """Equal state: tensors element for element (a step counted in a tensor or an int alike), the rest by ==."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and a.dim() > 0:
        return torch_equal(a, b)
    return float(a) == float(b) if isinstance(a, torch.Tensor) else a == b


def test_a_round_trip_through_every_layout_gives_back_the_same_training_state(tmp_path):
    """DDP's state.pt -> DeepSpeed's universal folder -> FSDP's DCP folders -> state.pt again: the same weights,
    AdamW moments and steps, param groups and scheduler, read with torch.load alone."""
    run = killed_at_interval(tmp_path, "ddp")
    for to in ("deepspeed", "fsdp", "ddp"):
        result = convert(run, "--to", to, "-o", tmp_path / to)
        assert result.exit_code == 0, result.output
        run = tmp_path / to
    original = torch.load(step_dir(shared_run("ddp") / "checkpoints", INTERVAL) / "state.pt", weights_only=False)
    back = torch.load(step_dir(run / "checkpoints", INTERVAL) / "state.pt", weights_only=False)
    assert same(dict(back["model"]), dict(original["model"]))
    assert same(back["optimizer"], original["optimizer"]) and same(back["scheduler"], original["scheduler"])


def test_a_zero2_offload_checkpoint_converts_to_the_weights_deepspeed_consolidates(tmp_path):
    """DeepSpeed's CPU Adam counts its step in an int; torch's AdamW gets it as a tensor."""
    run = killed_at_interval(tmp_path, "zero2_offload")
    result = convert(run, "--to", "single", "-o", tmp_path / "single")
    assert result.exit_code == 0, result.output
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = torch.load(step_dir(tmp_path / "single" / "checkpoints", INTERVAL) / "state.pt", weights_only=False)
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=step_dir(run, INTERVAL).name)
    assert same(dict(state["model"]), dict(theirs))
    steps = [moments["step"] for moments in state["optimizer"]["state"].values()]
    assert all(isinstance(step, torch.Tensor) and float(step) == INTERVAL for step in steps)


@pytest.mark.parametrize("name", ["zero2", "zero3 in sub-groups, activation checkpointing"])
def test_zero_files_read_one_tensor_at_a_time_give_deepspeeds_own_universal_conversion(tmp_path, name):
    """The whole training state, read from each rank's partitions by training/checkpoint/zero_files.py, equals what
    DeepSpeed's ds_to_universal gathers from them. ZeRO-3 splits each param group into sub-groups of
    sub_group_size elements (partitioned, and numbered, apart), and checkpointing wraps the parameters' names."""
    from distsetup.formats.checkpoint_folder import Marker
    from distsetup.training.checkpoint import universal_folder
    from distsetup.training.checkpoint.convert import parameter_groups
    from distsetup.training.checkpoint.named_state import named_state

    if name == "zero2":
        path = step_dir(shared_run(name) / "checkpoints", INTERVAL)
    else:
        zero3 = {**DS_FILES["zero3"]["zero_optimization"], "sub_group_size": 4000}
        training = {**TRAINING, "micro_batch_size": 12, "max_steps": 4, "checkpoint_interval": 4}
        config = write_config(
            tmp_path / "run",
            "zero3",
            "deepspeed",
            {**DS_FILES["zero3"], "zero_optimization": zero3},
            {**training, "activation_checkpointing": "full"},
        )
        result = train(config, 2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        path = step_dir(tmp_path / "run" / "out" / "checkpoints", 4)
        shapes = torch.load(path / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)["param_shapes"]
        assert len(shapes) > 4 and "_checkpoint_wrapped_module" in str(shapes)  # what this case is about
    groups = parameter_groups(Marker.read(path).model)
    universal_folder.from_deepspeed(path, tmp_path / path.name)
    ours, theirs = named_state(path, "zero", groups), named_state(tmp_path / path.name, "universal", groups)
    assert same(ours, theirs)
    assert len(ours["optimizer"]["state"]) == sum(map(len, groups)) == len(groups[0]) + len(groups[1])
    decay, no_decay = (group["weight_decay"] for group in ours["optimizer"]["param_groups"])
    assert decay > 0 == no_decay  # each group's own settings, not its first sub-group's


def test_zero_files_that_do_not_make_this_runs_parameters_are_refused(tmp_path):
    from distsetup.formats.checkpoint_folder import Marker
    from distsetup.training.checkpoint.convert import parameter_groups
    from distsetup.training.checkpoint.named_state import named_state

    path = tmp_path / "step"
    shutil.copytree(step_dir(shared_run("zero2") / "checkpoints", INTERVAL), path)
    groups = parameter_groups(Marker.read(path).model)
    with pytest.raises(
        ValueError, match="parameter blocks.9.mlp.fc.weight of this run's model is not in the checkpoint"
    ):
        named_state(path, "zero", [groups[0] + ["blocks.9.mlp.fc.weight"], groups[1]])
    rank1 = path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    saved = torch.load(rank1, weights_only=False)
    mapping = saved["optimizer_state_dict"]["param_slice_mappings"][0]
    lost = next(name for name in mapping if name != next(iter(mapping)))  # a parameter rank 1 holds
    del mapping[lost]
    torch.save(saved, rank1)
    with pytest.raises(ValueError, match=f"the ranks' fragments of {lost} do not make its"):
        named_state(path, "zero", groups)


def test_convert_refuses_in_one_line_and_writes_nothing(tmp_path):
    run = killed_at_interval(tmp_path, "ddp")
    same = convert(run, "--to", "single", "-o", tmp_path / "new")
    assert same.exit_code == 1 and "already resumes under single as it is" in same.output
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    taken = convert(run, "--to", "fsdp", "-o", tmp_path / "taken")
    assert taken.exit_code == 1 and "-o" in taken.output and (tmp_path / "taken" / "x").read_text() == "mine"
    empty = convert(tmp_path / "taken", "--to", "fsdp", "-o", tmp_path / "new")
    assert empty.exit_code == 1 and "no complete checkpoint" in empty.output
    (step_dir(run / "checkpoints", INTERVAL) / "state.pt").write_bytes(b"\0" * 1)  # damaged: passed over
    damaged = convert(run, "--to", "fsdp", "-o", tmp_path / "new")
    assert damaged.exit_code == 1 and "no complete checkpoint" in damaged.output
    assert not (tmp_path / "new").exists() and "Traceback" not in same.output + taken.output + damaged.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "taken"]  # no staging folder left behind

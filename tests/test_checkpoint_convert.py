"""`distsetup checkpoint convert`: a checkpoint rewritten offline for another backend is resumed by it as its own,
at another world size, and continues the uninterrupted run's loss curve; the source is only read; bad requests are
one line that writes nothing."""

import json
import re
import shutil

import pytest
from click.testing import CliRunner
from train_runs import (
    GLOBAL_BATCH,
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
from distsetup.training.export import consolidated_state_dict

# case -> (source run, --to, processes resuming it, their backend file, micro-batch, accumulation)
CONVERSIONS = {
    "zero3 2 -> fsdp 2": ("zero3", "fsdp", 2, lambda: RUNS["fsdp_full"][2], 12, 1),
    "ddp 2 -> deepspeed, zero1 on 3": ("ddp", "deepspeed", 3, lambda: ds_split("zero1", 3, 4), 4, 2),
    "zero2 2 -> single": ("zero2", "single", 1, lambda: None, GLOBAL_BATCH, 1),
}


def killed_at_interval(tmp_path, source: str):
    """A run folder holding step 10 of the shared run `source`: what a job killed after step 10 leaves."""
    run = tmp_path / "source"
    shutil.copytree(step_dir(shared_run(source) / "checkpoints", INTERVAL), step_dir(run / "checkpoints", INTERVAL))
    return run


def convert(*args):
    return CliRunner().invoke(cli, ["checkpoint", "convert", *map(str, args)])


@pytest.mark.slow
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
    resumed, uninterrupted = losses(tmp_path / "out"), losses(shared_run(source))[INTERVAL:]
    assert len(resumed) == STEPS - INTERVAL >= 20
    assert resumed == pytest.approx(uninterrupted, rel=1e-4)
    weights, reference = final_weights(tmp_path / "out"), final_weights(shared_run(source))
    # qkv biases aside: see test_resume_elsewhere
    drift = {k: float((weights[k] - v).norm() / v.norm()) for k, v in reference.items() if "qkv.bias" not in k}
    assert max(drift.values()) < 1e-4, sorted(drift.items(), key=lambda kv: -kv[1])[:3]


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


@pytest.mark.slow
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

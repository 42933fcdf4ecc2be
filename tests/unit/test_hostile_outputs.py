"""Hostile outputs: no command writes over one of its own inputs (named alike, reached through a link, or a run
config of any name), and an output that is a dangling symbolic link, a loop of them, or no regular file is refused
in one line and left as it was."""

import json
import os

import pytest
from hostile_input import RUN_CONFIG, one_line_error

from distsetup.cli.output import write_atomic
from distsetup.errors import DistsetupError

# --- no command writes over one of its own inputs ----------------------------------------------------


@pytest.mark.parametrize(
    "args, victim, what",
    [
        (["launcher", "--config", "config.yaml", "-o", "config.yaml"], "config.yaml", "run config"),
        (["slurm", "--config", "config.yaml", "-o", "config.yaml"], "config.yaml", "run config"),
        (
            ["launcher", "--deepspeed_config", "good.json", "--num_gpus_per_node", "2", "-o", "good.json"],
            "good.json",
            "DeepSpeed config",
        ),
        (
            ["slurm", "--deepspeed_config", "good.json", "--num_gpus_per_node", "2", "-o", "./sub/../good.json"],
            "good.json",
            "DeepSpeed config",
        ),
        (
            ["launcher", "--config", "config.yaml", "--script", "train.py", "-o", "train.py"],
            "train.py",
            "training script",
        ),
    ],
)
def test_output_equal_to_an_input_is_refused(run_cli, here, args, victim, what):
    (here / "sub").mkdir()
    (here / "train.py").write_text("print('train')\n")
    before = (here / victim).read_text()
    one_line_error(run_cli(*args), f"is this command's {what}", "choose another --output")
    assert (here / victim).read_text() == before


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_output_reaching_an_input_through_a_link_is_refused(run_cli, here, link):
    (os.symlink if link == "symlink" else os.link)("config.yaml", here / "run.sh")
    one_line_error(run_cli("launcher", "--config", "config.yaml", "-o", "run.sh"), "is this command's run config")
    assert (here / "config.yaml").read_text() == RUN_CONFIG


def test_plan_write_never_replaces_its_run_config(run_cli, here):
    """A run config may have any name: one called ds_config.json in the --write folder is not overwritten."""
    (here / "cfg").mkdir()
    (here / "cfg" / "ds_config.json").write_text(RUN_CONFIG)
    result = run_cli(
        "plan",
        "--config",
        "cfg/ds_config.json",
        "--num_gpus",
        "8",
        "--gpu_memory",
        "80GB",
        "--strategy",
        "zero3",
        "--write",
        "cfg",
    )
    assert result.exit_code == 1 and "--write" in result.stderr and "is this command's run config" in result.stderr
    assert (here / "cfg" / "ds_config.json").read_text() == RUN_CONFIG


def test_write_atomic_takes_the_inputs(tmp_path):
    source = tmp_path / "in.yaml"
    source.write_text("x")
    with pytest.raises(DistsetupError, match="is this command's run config"):
        write_atomic(source, "y", inputs={"run config": str(source)})
    write_atomic(tmp_path / "out.sh", "y", inputs={"run config": str(source), "nothing": None})
    assert source.read_text() == "x" and (tmp_path / "out.sh").read_text() == "y"


# --- an output that is a symbolic link ---------------------------------------------------------------


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: os.symlink("nowhere.json", d / "out.json"), "which does not exist"),
        (lambda d: (os.symlink("loop2", d / "out.json"), os.symlink("out.json", d / "loop2")), "cannot be followed"),
    ],
)
def test_output_link_to_nothing_or_a_loop_is_refused_and_kept(run_cli, tmp_path, make, words):
    make(tmp_path)
    target = os.readlink(tmp_path / "out.json")
    one_line_error(run_cli("deepspeed", "-o", tmp_path / "out.json"), "--output", "symbolic link", words)
    assert os.readlink(tmp_path / "out.json") == target  # still the user's link, not a regular file


def test_output_link_to_a_file_writes_the_file_and_keeps_the_link(run_cli, tmp_path):
    (tmp_path / "real.json").write_text("old")
    os.symlink("real.json", tmp_path / "out.json")
    assert run_cli("deepspeed", "--zero_stage", "2", "-o", tmp_path / "out.json").exit_code == 0
    assert os.readlink(tmp_path / "out.json") == "real.json"
    assert json.loads((tmp_path / "real.json").read_text())["zero_optimization"]["stage"] == 2


def test_output_that_is_not_a_regular_file_is_refused(run_cli, tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    one_line_error(run_cli("fsdp", "-o", tmp_path / "fifo.json"), "--output", "not a regular file")

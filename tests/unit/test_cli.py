"""Behaviour every command shares: help with examples, both flag spellings, completion, safe writes."""

import json
import os
import subprocess
import sys

import click
import pytest
from hostile_input import one_line_error
from repo import REPO, heavy_imports, run_subprocess_cli

from distsetup.cli.main import COMMANDS, cli
from distsetup.cli.output import write_atomic

# One real invocation per generating command, run in a fresh interpreter to watch sys.modules.
GENERATING_COMMANDS = [
    ["deepspeed", "--zero_stage", "3", "--offload_param", "--bf16", "--world_size", "8"],
    ["fsdp", "--mixed_precision", "BFLOAT16"],
    ["validate", "config/config.yaml"],
    ["launcher", "--config", "config/config.yaml", "--num_gpus_per_node", "2", "-o", "-"],
    [
        "slurm",
        "--config",
        "config/config.yaml",
        "--num_nodes",
        "2",
        "--num_gpus_per_node",
        "4",
        "--time_limit",
        "1:00:00",
        "--cpus_per_task",
        "8",
        "-o",
        "-",
    ],
    [
        "job",
        "--target",
        "trainjob",
        "--config",
        "config/config.yaml",
        "--num_gpus_per_node",
        "8",
        "--image",
        "i",
        "-o",
        "-",
    ],
    ["validate", "tests/support/golden/job_trainjob.yaml"],
    ["plan", "--params", "7B", "--num_gpus", "8", "--gpu_memory", "80GB"],
    ["checkpoint", "ls", "tests"],
]


@pytest.mark.parametrize("args", GENERATING_COMMANDS, ids=lambda a: a[0])
def test_generating_never_imports_torch_or_deepspeed(args):
    # ...nor jsonschema, which only explains files that fast_schema.conforms did not accept.
    watched = ("torch", "deepspeed", "transformers", "accelerate", "jsonschema")
    assert heavy_imports(args, watched) == ([], 0)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_help_shows_a_real_example(run_cli, name):
    result = run_cli(name, "--help")
    assert result.exit_code == 0
    assert "Examples:" in result.stdout and f"distsetup {name} " in result.stdout


def test_python_dash_m_and_version():
    out = run_subprocess_cli("--version", cwd=REPO)
    assert out.returncode == 0 and "distsetup, version" in out.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (["launcher", "--fo"], "Error: No such option '--fo'. HINT: `distsetup launcher --help` says what it takes."),
        (["lunch"], "Error: No such command 'lunch'. HINT: `distsetup --help` says what it takes."),
        (["--fo"], "Error: No such option '--fo'. HINT: `distsetup --help` says what it takes."),
        (["checkpoint", "ls"], "Error: Missing argument 'RUN'. HINT: `distsetup checkpoint ls --help` says"),
        # a value of another type or range, as Click says it (it exited 1 where docs/reference.md says 2)
        (["deepspeed", "--zero_stage", "two"], "Error: --zero_stage: 'two' is not a valid integer. HINT: `distsetup"),
        (["deepspeed", "--zero_stage", "5"], "Error: --zero_stage: 5 is not in the range 0<=x<=3."),
    ],
)
def test_a_flag_click_refuses_is_one_line(args, said):
    """Click's usage errors printed the usage and a "Try ..." line before the error (four lines): one line, as
    every other mistake, with Click's exit status 2."""
    result = run_subprocess_cli(*args, cwd=REPO)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(said) and "Usage:" not in result.stderr, result.stderr


def test_an_argument_that_is_not_utf8_is_one_line():
    """A byte that is not UTF-8 (a lone surrogate here, as Python keeps it) ended in a traceback when the value was
    written into the script: one line, exit 1, as every mistake of distsetup's own."""
    result = run_subprocess_cli("launcher", "--script", "\udcff.py", cwd=REPO)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: the argument '\\xff.py' (after --script) is not UTF-8, and every file"), line


def every_command(group: click.Group):
    """Every command of `group`, and of its groups."""
    for command in (group.get_command(None, name) for name in group.list_commands(None)):
        yield command
        if isinstance(command, click.Group):
            yield from every_command(command)


def test_both_spellings_of_every_multiword_flag(run_cli):
    """Each --snake_case option also answers to --dash-case (and the reverse), in the subcommands of a group too
    (checkpoint export's --max_shard_size had no --max-shard-size)."""
    for command in every_command(cli):
        for param in command.params:
            long_names = [o for o in param.opts + param.secondary_opts if o.startswith("--")]
            multiword = [o for o in long_names if "_" in o or "-" in o[2:]]
            for name in multiword:
                twin = "--" + (name[2:].replace("_", "-") if "_" in name else name[2:].replace("-", "_"))
                assert twin in long_names, f"{command.name}: {name} has no {twin}"


def test_a_number_out_of_its_type_is_said_as_the_number_it_should_be(run_cli):
    """Click says "'two' is not a valid integer range" (and INTEGER RANGE in --help) of its range types: every
    option with a range takes distsetup's, which say "integer" and "float"."""
    ranges = [
        f"{command.name} {param.name}"
        for command in every_command(cli)
        for param in command.params
        if type(getattr(param.type, "inner", param.type)) in (click.IntRange, click.FloatRange)  # under Checked
    ]
    assert ranges == []
    assert "Error: --zero_stage: 'two' is not a valid integer. " in run_cli("deepspeed", "--zero_stage", "two").stderr
    assert "Error: --lr: 'x' is not a valid float. " in run_cli("deepspeed", "--lr", "x").stderr
    assert "INTEGER RANGE" not in run_cli("init", "--help").stdout


def test_shell_completion_completes_commands_and_flags():
    env = {**os.environ, "_DISTSETUP_COMPLETE": "bash_complete", "COMP_WORDS": "distsetup deep", "COMP_CWORD": "1"}
    out = subprocess.run([sys.executable, "-m", "distsetup"], env=env, capture_output=True, text=True, timeout=60)
    assert "deepspeed" in out.stdout
    env.update(COMP_WORDS="distsetup deepspeed --zero_st", COMP_CWORD="2")
    out = subprocess.run([sys.executable, "-m", "distsetup"], env=env, capture_output=True, text=True, timeout=60)
    assert "--zero_stage" in out.stdout


def test_output_folder_is_created_and_dry_run_writes_nothing(run_cli, tmp_path):
    out = tmp_path / "new" / "dir" / "ds.json"
    dry = run_cli("deepspeed", "--zero_stage", "1", "--output", out, "--dry_run")
    assert dry.exit_code == 0 and not out.exists() and json.loads(dry.stdout)["zero_optimization"]["stage"] == 1
    real = run_cli("deepspeed", "--zero_stage", "1", "--output", out)
    assert real.exit_code == 0 and json.loads(out.read_text()) == json.loads(dry.stdout)
    assert f"Wrote {out}" in real.stderr and "Next: distsetup launcher" in real.stderr


def test_dash_prints_to_stdout(run_cli):
    result = run_cli("fsdp", "--output", "-")
    assert json.loads(result.stdout)["fsdp_version"] == 2


def test_failed_command_leaves_the_existing_file_untouched(run_cli, tmp_path):
    out = tmp_path / "ds.json"
    out.write_text("previous")
    result = run_cli("deepspeed", "--bf16", "--fp16", "--output", out)
    assert result.exit_code == 1 and out.read_text() == "previous"


@pytest.mark.parametrize(
    "name, text, command, held",
    [
        ("config.yaml", "model:\n  n_layer: 2\n", "deepspeed", "a run config"),  # -o config.yaml: an easy slip
        ("train.py", "import torch\nprint(1)\n", "fsdp", "something that is no config"),
        ("fsdp.json", '{"fsdp_version": 2}', "deepspeed", "an FSDP config"),
        ("ds.json", '{"zero_optimization": {"stage": 1}}', "deepspeed", None),  # the same kind: regenerated
    ],
)
def test_a_config_is_written_over_a_config_of_its_kind_only(run_cli, tmp_path, name, text, command, held):
    """`distsetup deepspeed -o config.yaml` replaced the run config with JSON, `-o train.py` the script."""
    out = tmp_path / name
    out.write_text(text)
    result = run_cli(command, "--output", out)
    if held is None:
        assert result.exit_code == 0 and json.loads(out.read_text())["zero_optimization"], result.output
        return
    one_line_error(result, f"--output {out} holds {held}: writing a")
    assert out.read_text() == text


def test_write_atomic_never_leaves_half_a_file(tmp_path):
    target = tmp_path / "out.sh"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_atomic(target, 12345)  # fails while writing
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.sh"]
    write_atomic(target, "#!/bin/sh\n", executable=True)
    assert target.read_text() == "#!/bin/sh\n" and os.access(target, os.X_OK)


def test_weird_paths_with_spaces_and_quotes(run_cli, tmp_path):
    out = tmp_path / "my runs" / 'it\'s "quoted"' / "ds.json"
    assert run_cli("deepspeed", "--zero_stage", "2", "-o", out).exit_code == 0
    assert run_cli("validate", out).exit_code == 0


@pytest.mark.parametrize(
    "make_target",
    [
        lambda tmp: tmp / "afile" / "ds.json",  # a file where a folder should be
        lambda tmp: "/proc/no/such/ds.json",  # a folder nobody can create
    ],
)
def test_unwritable_output_is_one_clear_error(run_cli, tmp_path, make_target):
    (tmp_path / "afile").write_text("x")
    result = run_cli("deepspeed", "--zero_stage", "1", "-o", make_target(tmp_path))
    assert result.exit_code == 1 and result.stderr.startswith("Error: cannot write")
    assert len(result.stderr.strip().splitlines()) == 1


def test_binary_file_is_one_clear_error(run_cli, tmp_path):
    for name in ("bin.json", "bin.yaml"):
        (tmp_path / name).write_bytes(b"\xff\xfe\x00garbage")
        result = run_cli("validate", tmp_path / name)
        assert result.exit_code == 1 and "is not UTF-8 text" in result.stderr

"""The `distsetup slurm` command: what it writes and says, bad input that writes nothing, the old --module spelling,
--submit, and the warning about one CPU per node."""

import json
import os

import pytest

# --- the command ---------------------------------------------------------------------------------


def test_command_writes_the_script(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(
        "slurm",
        "--num-nodes",
        "4",
        "--num_gpus_per_node",
        "8",
        "--time_limit",
        "48:00:00",
        "--partition",
        "gpu",
        "--env_module",
        "cuda/12.4",
        "--env-module",
        "nccl",
        "--env",
        "A=1",
        "--sbatch",
        "reservation=big",
        "--requeue",
    )
    assert result.exit_code == 0, result.output
    script = tmp_path / "scripts" / "slurm_job.sh"
    text = script.read_text()
    assert os.access(script, os.X_OK)
    assert "Next: sbatch scripts/slurm_job.sh" in result.stderr
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --reservation=big",
        "module load nccl",
        "export A=1",
        f"export WORKDIR={tmp_path}",
    ):
        assert line in text
    assert "deprecated" not in result.stderr


def test_old_module_flag_still_loads_environment_modules(run_cli, tmp_path, monkeypatch):
    """`slurm --env_module` loads an environment module and --python_module names the Python module, as in `launcher`;
    the old --module still loads environment modules for one release, with one line naming the new flag."""
    monkeypatch.chdir(tmp_path)
    result = run_cli(
        "slurm",
        "--num_gpus_per_node",
        "2",
        "--cpus_per_task",
        "2",
        "--module",
        "cuda/12.4",
        "--module",
        "nccl",
        "--python_module",
        "pkg.train",
        "-o",
        "job.sh",
    )
    assert result.exit_code == 0, result.output
    text = (tmp_path / "job.sh").read_text()
    assert "module load cuda/12.4\nmodule load nccl\n" in text and "export MODULE=pkg.train" in text
    assert "--env_module cuda/12.4 --env_module nccl" in text.splitlines()[2]
    assert [line for line in result.stderr.splitlines() if "deprecated" in line] == [
        "Warning: `slurm --module` is deprecated and goes in the next release: use --env_module (same meaning)."
    ]
    both = run_cli("slurm", "--module", "a", "--env_module", "b", "-o", "-")
    assert both.exit_code != 0 and "give one of them" in both.output
    bad = run_cli("slurm", "--env_module", "cuda 12", "-o", "-")
    assert bad.exit_code != 0 and "--env_module 'cuda 12' is not an environment-module name" in bad.output
    help_text = run_cli("slurm", "--help").stdout
    assert "--env_module" in help_text and "--python_module" in help_text and "--module " not in help_text


def test_the_gpus_per_node_left_out_are_said(run_cli, tmp_path, monkeypatch):
    """Left out, --num_gpus_per_node is 1: `slurm --num_nodes 4` on nodes of 8 GPUs trained on 4 of 32, unsaid."""
    monkeypatch.chdir(tmp_path)
    result = run_cli("slurm", "--num_nodes", "4", "-o", "-")
    assert result.exit_code == 0 and "#SBATCH --gres=gpu:1" in result.stdout
    assert "Note: --num_gpus_per_node not given: 1 process a node" in result.stderr
    given = run_cli("slurm", "--num_nodes", "4", "--num_gpus_per_node", "8", "-o", "-")
    assert given.exit_code == 0 and "--num_gpus_per_node not given" not in given.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_nodes", "0"], "--num_nodes 0 must be at least 1"),
        (["--num_gpus_per_node", "0"], "--num_gpus_per_node 0 must be at least 1"),
        (["--num_gpus_per_node", "auto"], "needs a number"),
        (["--time_limit", "3 days"], "not one SLURM accepts"),
        (["--partition", "a b"], "not a SLURM partition name"),
        (["--env", "1X=2"], "not KEY=VALUE"),
        # given, and dropped without a word
        (["--signal_seconds", "60"], "--signal_seconds is read only with --requeue"),
        (["--gpu_request", "none", "--gpu_type", "a100"], "--gpu_type a100 names the GPUs asked for"),
        (
            ["--use_deepspeed", "--deepspeed_config", "ds.json", "--num_nodes", "2", "--num_gpus_per_node", "2"],
            "6 is not divisible by train_micro_batch_size_per_gpu 3 x world size 4",
        ),
    ],
)
def test_command_bad_input_writes_nothing(run_cli, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 3}))
    result = run_cli("slurm", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "scripts").exists()


def test_sbatch_option_of_a_flag_is_refused(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli("slurm", "--num_nodes", "2", "--num_gpus_per_node", "2", "--sbatch", "nodes=3")
    assert result.exit_code != 0 and "HINT: use --num_nodes" in result.output
    assert not (tmp_path / "scripts").exists()


@pytest.mark.parametrize("args, warned", [([], True), (["--cpus_per_task", "16"], False), (["--exclusive"], False)])
def test_warns_about_one_cpu_per_node(run_cli, tmp_path, monkeypatch, args, warned):
    """Bug: without --cpus_per_task SLURM may give each node's one task 1 CPU for all its processes."""
    monkeypatch.chdir(tmp_path)
    result = run_cli("slurm", "--num_gpus_per_node", "2", "-o", "-", *args)
    assert result.exit_code == 0, result.output
    assert ("--cpus_per_task 16 (8 per GPU)" in result.stderr) == warned


@pytest.mark.parametrize("made", [True, False])
def test_warns_about_a_venv_that_is_not_here(run_cli, tmp_path, monkeypatch, made):
    """--venv names the folder the job activates: one without bin/activate here is said when the script is written
    (the job itself stops with one line where there is none: test_errors_once_scripts)."""
    monkeypatch.chdir(tmp_path)
    if made:
        (tmp_path / "envs" / "train" / "bin").mkdir(parents=True)
        (tmp_path / "envs" / "train" / "bin" / "activate").write_text("")
    result = run_cli("slurm", "--venv", "envs/train", "--cpus_per_task", "8", "-o", "-")
    assert result.exit_code == 0, result.output
    assert ("Warning: --venv envs/train: no bin/activate there on this machine" in result.stderr) == (not made)


def test_submit_prints_the_job_id(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text('#!/bin/bash\n[[ "$1" == --parsable && -f "$2" ]] && echo "4242;cluster"\n')
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    result = run_cli("slurm", "--num_gpus_per_node", "2", "--submit")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "4242"
    assert run_cli("slurm", "--submit", "--dry_run").exit_code != 0


def test_no_config_is_no_warning_and_the_next_step_names_the_command_that_runs_the_script(
    run_cli, tmp_path, monkeypatch
):
    """The trainer runs on its defaults without --config (the wheel test trains so), so nothing warns."""
    monkeypatch.chdir(tmp_path)  # no config/config.yaml here
    for command, runner, extra in (
        ("launcher", "bash", []),
        ("slurm", "sbatch", ["--time_limit", "1:00:00", "--cpus_per_task", "8"]),
        # SLURM lists the nodes (the deepspeed launcher's hostfile too): nothing about labels or --hosts
        ("slurm", "sbatch", ["--time_limit", "1:00:00", "--cpus_per_task", "8", "--num_nodes", "2"]),
        ("slurm", "sbatch", ["--cpus_per_task", "8", "--num_nodes", "2", "--launch_method", "deepspeed"]),
    ):
        out = tmp_path / f"my {command}.sh"
        result = run_cli(command, "--num_gpus_per_node", "2", *extra, "-o", out)
        assert result.exit_code == 0, result.output
        assert "Warning" not in result.stderr and "--config" not in result.stderr
        assert f"Next: {runner} '{out}'" in result.stderr

"""The scripts distsetup writes check the run config once when they start, before any launcher: with the trainer's
--check, on the interpreter the launcher runs the trainer on; the SLURM job in its batch shell, before srun. Scripts
run under bash with fake launchers that print what they were given. (run_training.sh with the real torchrun:
tests/processes/test_errors_once_runs.py.)"""

import sys
from pathlib import Path

import pytest
from shell_checks import fake_tools, run_script, srun_program
from slurm_scripts import build as build_slurm

from distsetup.scripts.launch_plan import LaunchSpec, build_launcher_script

CHECK = '--check "${TRAIN_ARGS[@]}" "$@"'
BAD = "training:\n  lerning_rate: 0.1\n"
VENV = Path(sys.executable).parent.parent


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("method", ["torchrun", "deepspeed"])
def test_slurm_job_checks_the_run_config_once_in_the_batch_shell_before_srun(tmp_path, method):
    launch = {"launch_method": method, "workdir": str(tmp_path)}
    if method == "deepspeed":
        launch.update(backend="deepspeed", deepspeed_config="ds.json")
    text = build_slurm(nodes=2, gpus=2, venv=str(VENV), launch=launch)
    assert text.count(CHECK) == 1 and CHECK not in srun_program(text)  # once, not on every node
    assert text.index('cd "$WORKDIR"') < text.index("/bin/activate") < text.index(CHECK)
    assert text.index(CHECK) < text.index('srun "${SRUN_ARGS[@]}"')
    (tmp_path / "config.yaml").write_text(BAD)  # edited since the script was written
    (tmp_path / "ds.json").write_text("{}")
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    result = run_script(text, tmp_path, "srun", "scontrol", env=env, args=["training.max_steps=3"])
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert "training.lerning_rate" in line and "did you mean 'learning_rate' (read as lr)?" in line
    assert result.stdout == ""  # srun never ran
    assert "distsetup: job 7" not in result.stderr


def test_slurm_job_without_its_venv_stops_in_one_line_before_srun(tmp_path):
    """A --venv the first node does not have (a typo, a path of another machine): one line naming it, exit 1, no
    node started; bash's own "No such file or directory" before."""
    text = build_slurm(nodes=2, gpus=2, venv=f"{tmp_path}/no env", launch={"workdir": str(tmp_path)})
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    result = run_script(text, tmp_path, "srun", "scontrol", env=env)
    assert (result.returncode, result.stdout) == (1, "")  # srun never ran
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"distsetup: --venv {tmp_path}/no env: no bin/activate there on "), line


def test_the_check_runs_on_the_python_beside_the_launcher_with_the_launchs_arguments(tmp_path):
    """The launcher runs the trainer on its own interpreter: that of a venv or conda env sits beside it."""
    text = build_launcher_script(LaunchSpec(config="c.yaml", nproc_per_node=2), command_line="distsetup launcher")
    fake = fake_tools(tmp_path, "torchrun")
    (fake / "python3").write_text('#!/bin/bash\necho "python3 beside torchrun"\nprintf "%s\\n" "$@"\n')
    (fake / "python3").chmod(0o755)
    result = run_script(text, tmp_path, "torchrun", args=["training.max_steps=3"])
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    check = ["python3 beside torchrun", "-m", "distsetup.train", "--check"]
    assert argv[: len(check) + 4] == [*check, "--config", "c.yaml", "distributed.backend=ddp", "training.max_steps=3"]
    assert argv.index("--nproc_per_node") > len(check)  # then the launch


def test_the_check_has_the_world_the_script_launches(tmp_path):
    """What a run config needs of the world is checked with the world the script launches, before torchrun: backend
    single asked of 2 processes, a DeepSpeed file's batch made for another world (edited since the script); and the
    backend's file as the ranks read it (a value its reader would refuse, once a traceback of the check)."""
    (tmp_path / "c.yaml").write_text("training:\n  micro_batch_size: 4\n")
    (tmp_path / "ds.json").write_text('{"train_batch_size": 4}')  # 4 x 1 x 1: one process
    (tmp_path / "auto.json").write_text('{"train_batch_size": "auto"}')
    (tmp_path / "fsdp.json").write_text('{"fsdp_version": 2, "mixed_precision": "bf17"}')
    spec = LaunchSpec(config="c.yaml", nproc_per_node=2, workdir=str(tmp_path))
    text = build_launcher_script(spec, command_line="distsetup launcher")
    deepspeed = ["distributed.backend=deepspeed", "distributed.deepspeed_config=ds.json"]
    for args, named in (
        (["distributed.backend=single"], "distributed.backend: single trains one process, without a process group, "),
        (deepspeed, "training.micro_batch_size: DeepSpeed file ds.json's train_batch_size 4 "),
        (["distributed.backend=deepspeed", "distributed.deepspeed_config=auto.json"], 'train_batch_size: "auto"'),
        (["distributed.backend=fsdp", "distributed.fsdp_config=fsdp.json"], "mixed_precision"),
    ):
        result = run_script(text, tmp_path, "torchrun", args=args)
        assert result.returncode == 1 and result.stdout == "", result.stdout  # torchrun never ran
        (line,) = error_lines(result.stderr)
        assert named in line, line
    launched = run_script(text, tmp_path, "torchrun", args=["training.micro_batch_size=2", *deepspeed])
    assert launched.returncode == 0 and "--nproc_per_node" in launched.stdout, launched.stderr  # 2 x 1 x 2


def test_a_users_own_program_gets_no_check_and_the_trainers_old_path_does():
    """A user's script or module owns its arguments; src/train.py (the trainer's old path) takes --check."""
    for target in ({"script": "mine.py"}, {"module": "pkg.train"}):
        assert "--check" not in build_launcher_script(LaunchSpec(config="c.yaml", **target), command_line="d")
        assert "--check" not in build_slurm(launch=dict(target))
    text = build_launcher_script(LaunchSpec(config="c.yaml", script="src/train.py"), command_line="d")
    assert f'"$PYTHON" "$SCRIPT" {CHECK}' in text


@pytest.mark.parametrize("kind", ["launcher", "slurm"])
def test_a_missing_training_script_is_one_line_before_any_launcher(tmp_path, kind):
    """A user's --script that is not in the folder the script starts it from stops the script in one line, before
    torchrun or srun (which would print a traceback per process); once the file is there, the launch goes on."""
    launch = {"script": "mine.py", "workdir": str(tmp_path)}
    launcher, env = "torchrun", {}
    text = build_launcher_script(LaunchSpec(nproc_per_node=2, **launch), command_line="distsetup launcher")
    if kind == "slurm":
        launcher, env = "srun", {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
        text = build_slurm(nodes=2, gpus=2, launch=launch)
    result = run_script(text, tmp_path, launcher, "scontrol", env=env)
    assert result.returncode == 1 and result.stdout == "", result.stdout  # the launcher never ran
    (line,) = [line for line in result.stderr.splitlines() if "mine.py" in line]
    assert line.startswith(f"distsetup: no training script mine.py in {tmp_path}: create it, or regenerate"), line
    (tmp_path / "mine.py").write_text("")
    launched = run_script(text, tmp_path, launcher, "scontrol", env=env)
    assert launched.returncode == 0 and launched.stdout, launched.stderr  # the launcher ran


def test_a_script_given_with_its_arguments_is_refused_and_one_not_there_yet_noted(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")
    refused = run_cli("launcher", "--script", "mine.py --epochs 3", "--num_gpus_per_node", 2, "-o", "run.sh")
    assert refused.exit_code == 1 and not (tmp_path / "run.sh").exists()
    assert "give --script mine.py, and the arguments when you run it: bash run.sh --epochs 3" in refused.output
    for given in ("later.py --epochs 3", "later.py --config conf.py"):  # no file yet
        not_yet = run_cli("launcher", "--script", given, "--num_gpus_per_node", 2, "-o", "run.sh")
        assert not_yet.exit_code == 1 and "give --script later.py, and the arguments" in not_yet.output, given
    spaced = run_cli("launcher", "--script", "my later.py", "--num_gpus_per_node", 2, "-o", "run.sh")
    assert spaced.exit_code == 0 and "--script my later.py: no such file" in spaced.output  # a name with a space
    noted = run_cli("launcher", "--script", "later.py", "--num_gpus_per_node", 2, "-o", "run.sh")
    assert noted.exit_code == 0 and (tmp_path / "run.sh").exists()
    assert f"--script later.py: no such file in {tmp_path} yet" in noted.output
    (tmp_path / "trainer").mkdir()  # a folder is no script (it was noted as a file "not there yet")
    folder = run_cli("launcher", "--script", "trainer", "--num_gpus_per_node", 2, "-o", "other.sh")
    assert (
        folder.exit_code == 1
        and "--script trainer is a folder" in folder.output
        and not (tmp_path / "other.sh").exists()
    )

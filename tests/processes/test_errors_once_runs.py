"""One error, once: a bad run config under torchrun at 2 processes is one line (the first rank says it, the other
exits with the same status, silently), as is a data problem found once the process group exists, and a launcher
script whose run config was edited since it was written says the problem in one line and starts no torchrun."""

import subprocess

import pytest
import yaml
from train_runs import command, environment, write_config, write_run_config

TYPO = "lerning_rate"


def test_a_bad_run_config_is_said_once_by_two_ranks_under_torchrun(tmp_path):
    config = write_run_config(tmp_path, "ddp")
    config.write_text(config.read_text().replace("training:\n", f"training:\n  {TYPO}: 0.1\n", 1))
    result = subprocess.run(
        command(config, 2), capture_output=True, text=True, timeout=300, env=environment(), cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    said = [line for line in output.splitlines() if TYPO in line]
    assert len(said) == 1, output[-3000:]
    assert said[0].startswith("error: run config problem") and "did you mean 'learning_rate' (read as lr)?" in said[0]
    assert len([line for line in output.splitlines() if line.startswith("error:")]) == 1
    # both ranks exit with the error's status (torchrun's summary), the silent one too
    assert [line.split(":")[1].split()[0] for line in output.splitlines() if line.strip().startswith("exitcode")] == [
        "1",
        "1",
    ], output[-3000:]


# A model of 8 inputs, and samples of 10: its forward rejects the first batch on every rank
MISFIT = """\
import torch


def build_model():
    return torch.nn.Linear(8, 1)


def build_data(split):
    return torch.utils.data.TensorDataset(torch.randn(64, 10), torch.randn(64, 1))


def three_samples(split):
    n = 3 if split == "train" else 64
    return torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
"""


@pytest.mark.parametrize(
    "problem", ["empty data file", "first batch rejected", "fewer samples than a batch", "W&B without a login"]
)
def test_a_problem_every_rank_finds_after_the_process_group_is_said_once_too(tmp_path, problem):
    """The data is read, the model built and its first batch run once the process group exists: every rank finds
    such a problem alike, one says it. W&B starts on rank 0 alone, while the others wait for its answer (they lost
    contact with it, in a second error)."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "misfit.py").write_text(MISFIT)
    env = environment()
    if problem == "W&B without a login":
        config = write_config(tmp_path, "ddp", "ddp", None, {"max_steps": 2, "report_to": ["wandb"]})
        env = {k: v for k, v in env.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED")}
        env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))  # no ~/.netrc: no login
        expected = "error: training.report_to wandb:"
    elif problem == "empty data file":
        config = write_config(
            tmp_path, "ddp", "ddp", None, {"max_steps": 2}, data={"type": "files", "paths": ["empty.txt"]}
        )
        expected = "error: data file empty.txt is empty."
    else:
        builder = "misfit:build_data" if problem == "first batch rejected" else "misfit:three_samples"
        config = write_config(
            tmp_path, "ddp", "ddp", None, {"max_steps": 2}, data={"type": "python", "builder": builder}
        )
        settings = yaml.safe_load(config.read_text())
        settings["model"] = {"type": "python", "builder": "misfit:build_model"}
        config.write_text(yaml.safe_dump(settings))
        expected = (
            "error: model.builder misfit:build_model's model rejected the first batch"
            if problem == "first batch rejected"
            else "error: the dataset has 3 samples, fewer than one global batch of"
        )
    result = subprocess.run(command(config, 2), capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    said = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(expected), output[-3000:]
    assert output.count(expected[len("error: ") :]) == 1, output[-3000:]  # the other rank said nothing, not mid-line


def test_a_launcher_script_checks_its_run_config_before_starting_torchrun(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_run_config(tmp_path, "ddp", max_steps=2)
    result = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", 2, "-o", "run.sh")
    assert result.exit_code == 0, result.output
    good = config.read_text()
    config.write_text(good.replace("training:\n", f"training:\n  {TYPO}: 0.1\n", 1))  # edited since
    for text, args in ((config.read_text(), ()), (good, (f"training.{TYPO}=0.1",))):  # or a bad argument
        config.write_text(text)
        run = subprocess.run(
            ["bash", "run.sh", *args], capture_output=True, text=True, timeout=120, env=environment(), cwd=tmp_path
        )
        output = run.stdout + run.stderr
        assert run.returncode == 1, output
        said = [line for line in output.splitlines() if TYPO in line]
        assert len(said) == 1 and said[0].startswith("error: run config problem"), output
        for launched in ("torchrun", "ChildFailedError", "Traceback", "distsetup: node"):
            assert launched not in output, output
    assert not (tmp_path / "out").exists()

"""An error found before the process group is said by one rank per node: which rank speaks, what the others do (wait
for the launcher to stop them, else say it themselves), and the trainer's --check, the launch scripts' one check,
which says a problem without importing torch. (Two real ranks under torchrun: tests/processes/test_errors_once_runs.py.)
"""

import json
import subprocess
import sys

import pytest
from repo import REPO

from distsetup import train
from distsetup.training.launch_env import World

BAD = "training:\n  lerning_rate: 0.1\n"
LAUNCHER_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


@pytest.mark.parametrize(
    "world, speaks",
    [
        (World(rank=0, local_rank=0, size=1, local_size=1), True),  # a plain run
        (World(rank=0, local_rank=0, size=8, local_size=8), True),  # torchrun, one node
        (World(rank=3, local_rank=3, size=8, local_size=8), False),
        (World(rank=4, local_rank=0, size=8, local_size=4), True),  # the second node's first rank
        (World(rank=5, local_rank=1, size=8, local_size=4), False),
        (World(rank=3, local_rank=0, size=8, local_size=8), False),  # RANK without LOCAL_RANK: rank 0 alone
    ],
)
def test_the_first_rank_of_each_node_speaks(world, speaks):
    assert train.speaks_for_its_node(world) is speaks


def run_main_as(monkeypatch, tmp_path, **launcher) -> tuple[int, list[float], dict]:
    """train.main on a bad run config, as the rank `launcher` describes: (status, the waits, the signal handlers)."""
    (tmp_path / "bad.yaml").write_text(BAD)
    for name in LAUNCHER_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    waits: list[float] = []
    handlers: dict = {}
    monkeypatch.setattr(train.time, "sleep", waits.append)
    monkeypatch.setattr(train.signal, "signal", handlers.__setitem__)  # the test process keeps its own
    return train.main(["--config", str(tmp_path / "bad.yaml")]), waits, handlers


def test_the_first_rank_says_it_at_once(monkeypatch, tmp_path, capsys):
    status, waits, handlers = run_main_as(monkeypatch, tmp_path, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    (line,) = capsys.readouterr().err.splitlines()
    assert status == 1 and waits == []
    assert line.startswith("error: run config problem") and "did you mean 'learning_rate' (read as lr)?" in line


def test_another_rank_leaves_it_to_the_first_and_exits_with_its_status_when_stopped(monkeypatch, tmp_path, capsys):
    """It waits for the launcher, which stops it with SIGTERM once the first rank has said the error and exited:
    then it exits with the same status, silently. Where nobody stops it, the error was its own: it says it."""
    status, waits, handlers = run_main_as(monkeypatch, tmp_path, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    assert waits == [train.SPEAKER_HEAD_START_S] and status == 1
    assert len(capsys.readouterr().err.splitlines()) == 1  # said after the wait only
    assert set(handlers) == {train.signal.SIGTERM, train.signal.SIGINT}
    stopped = []
    monkeypatch.setattr(train, "exit_now", stopped.append)
    handlers[train.signal.SIGTERM](train.signal.SIGTERM, None)
    assert stopped == [1] and capsys.readouterr().err == ""


@pytest.mark.parametrize("local_rank, said", [("0", True), ("1", False)])
def test_sigterm_during_set_up_is_a_preemption_said_once_per_node(monkeypatch, capfd, local_rank, said):
    """Before the trainer takes SIGTERM over, a preemption has nothing to checkpoint: the node's first rank says so
    (every rank exited in silence), and every rank exits 1, as for another rank's error, which stops the ranks with
    the same signal (then that node's speaker has already exited, and the others stay silent)."""
    for name, value in {"RANK": local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    handlers: dict = {}
    monkeypatch.setattr(train.signal, "signal", handlers.__setitem__)

    def stop_here(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "load_config", stop_here)
    with pytest.raises(KeyboardInterrupt):
        train.main(["--config", "run.yaml"])  # stopped right after taking SIGTERM
    stopped = []
    monkeypatch.setattr(train, "exit_now", stopped.append)
    handlers[train.signal.SIGTERM](train.signal.SIGTERM, None)
    assert stopped == [1]
    lines = capfd.readouterr().err.splitlines()
    said_line = "stopped by SIGTERM during set-up (a preemption, or the launcher ending the ranks after another failed)"
    assert lines == ([said_line] if said else [])


def check(*args: str) -> subprocess.CompletedProcess:
    """`python -m distsetup.train --check ARGS` in a fresh interpreter, which then says whether it imported torch."""
    code = (
        "import sys\nfrom distsetup.train import main\nstatus = main(sys.argv[1:])\n"
        "print('torch' in sys.modules)\nsys.exit(status)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "--check", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_check_reads_the_run_config_and_the_arguments_as_a_run_does_without_torch(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD)
    (tmp_path / "good.yaml").write_text("training:\n  max_steps: 2\n")
    result = check("--config", str(tmp_path / "bad.yaml"), "distributed.backend=ddp")
    assert result.returncode == 1 and result.stdout == "False\n"
    (line,) = result.stderr.splitlines()  # said at once, whatever the rank: the scripts run it once
    assert line.startswith("error: run config problem") and "training.lerning_rate" in line
    result = check("--config", str(tmp_path / "good.yaml"), "training.learning_rte=1")  # an override, too
    assert result.returncode == 1 and "did you mean 'learning_rate' (read as lr)?" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stdout == "False\n"
    result = check("--config", str(tmp_path / "good.yaml"), "training.max_steps=3")
    assert (result.returncode, result.stdout, result.stderr) == (0, "False\n", "")
    # a byte that is not UTF-8 (a lone surrogate here) was called "not valid YAML" with a hint to quote it
    result = check("--config", str(tmp_path / "good.yaml"), "training.output_dir=out\udcff")
    assert result.returncode == 1 and result.stderr.startswith("error: the argument 'training.output_dir=out\\xff'")
    assert "is not UTF-8" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    # the DeepSpeed file read as the ranks read it, also where no WORLD_SIZE says the world (passed before)
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimizaton": {"stage": 2}}')
    result = check("--config", str(tmp_path / "good.yaml"), "--deepspeed", str(tmp_path / "ds.json"))
    assert result.returncode == 1 and "zero_optimizaton: unknown key" in result.stderr, result.stderr


def test_check_builds_a_hugging_face_model_on_meta_where_the_run_config_names_its_classes(tmp_path):
    """A Hugging Face model's class typo and an FSDP file wrapping the built-in GPT's Block (what `distsetup fsdp`
    writes unless told the model's) passed --check; every rank then refused them after torchrun started them."""
    model = {"type": "hf", "hf_path": str(REPO / "examples" / "hf_moe" / "model"), "vocab_size": 316}
    (tmp_path / "typo.yaml").write_text(json.dumps({"model": {**model, "layer_classes": ["MixtralDecoderLayr"]}}))
    result = check("--config", str(tmp_path / "typo.yaml"))
    assert result.returncode == 1 and "no module of class MixtralDecoderLayr" in result.stderr, result.stderr
    assert "did you mean MixtralDecoderLayer" in result.stderr and len(result.stderr.splitlines()) == 1
    fsdp = {"backend": "fsdp", "fsdp": {"fsdp_transformer_layer_cls_to_wrap": "Block"}}
    (tmp_path / "fsdp.yaml").write_text(json.dumps({"model": model, "distributed": fsdp}))
    result = check("--config", str(tmp_path / "fsdp.yaml"))
    assert result.returncode == 1 and "fsdp_transformer_layer_cls_to_wrap: no module of class Block" in result.stderr
    (tmp_path / "good.yaml").write_text(json.dumps({"model": model, "distributed": {"backend": "fsdp"}}))
    assert check("--config", str(tmp_path / "good.yaml")).returncode == 0

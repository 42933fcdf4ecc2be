"""The files `distsetup init` writes train: answered by a person at a real pseudo-terminal, on 2 CPU processes.
With --yes for two SLURM nodes, they run as one world on the test cluster (tests/processes/test_slurm_jobs.py: the
cluster's tests share one module)."""

import json
import subprocess

import pexpect
from init_terminal import environment, files_in, spawn_init
from repo import run_subprocess_cli
from shell_checks import shellcheck


def test_a_person_answers_in_a_terminal_and_the_files_validate_and_train(tmp_path):
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    init = spawn_init(tmp_path, "--max_steps", "3")
    init.expect_exact("no GPU")
    init.expect_exact("Model: a built-in size")
    init.sendline("models/nothing-here")  # a wrong answer is said and asked again
    init.expect_exact("neither a built-in size nor a folder")
    init.expect_exact("Model: a built-in size")
    init.sendline("tiny")
    init.expect_exact("Training data")
    init.sendline("corpus.txt")
    init.expect_exact("Where it runs")
    init.sendline("")  # local
    init.expect_exact("Nodes [1]")
    init.sendline("")
    init.expect_exact("Memory of one GPU")
    init.sendline("")  # none: a CPU setup
    init.expect_exact("CPU processes per node")
    init.sendline("0")
    init.expect_exact("not in the range")
    init.sendline("2")
    init.expect_exact("Precision (fp32, bf16, fp16) [fp32]")
    init.sendline("")
    init.expect_exact("Global batch (samples per optimizer step) [16]")
    init.sendline("7")  # an answer that fails with an earlier one (2 processes) is asked again too
    init.expect_exact("is not divisible by the 2 processes")
    init.expect_exact("Global batch (samples per optimizer step) [16]")
    init.sendline("12")
    init.expect(pexpect.EOF)
    init.close()
    assert init.exitstatus == 0, init.before
    assert "Batch: micro-batch 6 x accumulation 1 x 2 = global batch 12." in init.before
    assert "Next: bash scripts/run_training.sh" in init.before
    assert files_in(tmp_path) == ["config/config.yaml", "corpus.txt", "scripts/run_training.sh"]
    shellcheck([tmp_path / "scripts" / "run_training.sh"])
    checked = run_subprocess_cli("validate", "config/config.yaml", "--world_size", 2, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    run = subprocess.run(
        ["bash", "scripts/run_training.sh"],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())
    assert (summary["backend"], summary["world_size"], summary["steps"]) == ("ddp", 2, 3)

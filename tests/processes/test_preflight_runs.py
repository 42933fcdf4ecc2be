"""Preflight on real ranks: two under torchrun succeed (rank 0 alone reports), and `distsetup doctor --preflight`
runs the same check."""

import os
import subprocess
import sys

import pytest
from repo import REPO, run_subprocess_cli

pytest.importorskip("torch")


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_two_ranks_under_torchrun_succeed():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "distsetup.preflight",
            "--timeout",
            "30",
            "--size_mb",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ok = [line for line in out.stdout.splitlines() if line.startswith("preflight OK")]
    assert len(ok) == 1  # rank 0 only
    assert "2 ranks" in ok[0] and "all-reduce" in ok[0] and "barrier" in ok[0]


def test_doctor_runs_the_preflight(tmp_path):
    out = run_subprocess_cli("doctor", "--preflight", "--nproc_per_node", "2", "--timeout", "30", cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "preflight OK: 2 ranks" in out.stdout

"""Fixtures every tier shares, and the tiers themselves: the folder a test is in is its tier.

tests/unit/       fast: in-process (Click's CliRunner), or one plain interpreter (`python -m distsetup`, a
                  one-process train.py run): `pytest tests/unit`, the same tests as `-m 'not slow'`
tests/processes/  start processes (torchrun, the deepspeed launcher, accelerate, sbatch on a test SLURM cluster) or
                  import a client (transformers, Accelerate): marked `slow` here
tests/gpu/        need a CUDA GPU: marked `gpu` (and `slow`) here, and deselected where torch sees no GPU, except
                  in the GPU check's dry run (GPU_CHECK_DRY=1: gpu/check.py), which runs them on the CPU
tests/support/    helpers and data, imported as top-level modules (setup.cfg: pythonpath = tests/support)

`make test` runs them on three pytest-xdist workers (`--dist loadfile`): a test module stays on one worker, so the
tests of the one SLURM cluster share a module; runs shared between modules are made once for every worker
(train_runs.py).
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hostile_input import RUN_CONFIG
from launch_inputs import DS_CONFIG
from repo import REPO, SHARED_RUNS_VARIABLE
from shell_checks import require_tool
from slurm_cluster import LocalSlurm, slurm_available

from distsetup.cli.main import cli

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
# Every process the tests start (torchrun, sbatch jobs, DeepSpeed's JIT builds) must find this
# interpreter's tools first: two ninja versions write incompatible build logs, and alternating between
# them recompiles DeepSpeed's CPU ops (30 s or more) on every run.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

TESTS = Path(__file__).resolve().parent
TIER_MARKERS = {"processes": ("slow",), "gpu": ("gpu", "slow")}


def pytest_configure(config):
    """The folder of the shared runs, made by the process that controls the run, so that pytest-xdist's workers
    (which inherit its environment) share it; removed when that process ends."""
    if hasattr(config, "workerinput"):
        return
    shared = tempfile.mkdtemp(prefix="distsetup-train-")
    os.environ[SHARED_RUNS_VARIABLE] = shared
    config.add_cleanup(lambda: shutil.rmtree(shared, ignore_errors=True))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by these markers
def pytest_collection_modifyitems(config, items):
    """Mark each test by its folder; without a GPU, deselect the GPU tier (deselected, not skipped: CI fails skips).
    The SLURM cluster's tests must share one module: two workers must not each start a cluster."""
    for item in items:
        path = Path(item.path).resolve()
        tier = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
        for marker in TIER_MARKERS.get(tier, ()):
            item.add_marker(marker)
    with_cluster = {item.path for item in items if "cluster" in getattr(item, "fixturenames", ())}
    if len(with_cluster) > 1:
        raise pytest.UsageError(f"the SLURM cluster's tests are in {sorted(map(str, with_cluster))}: keep them in one")
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not cuda_available() and os.environ.get("GPU_CHECK_DRY") != "1":  # the dry run: on the CPU
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU; without an NVIDIA device or driver, answered without importing torch."""
    if not (Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi")):
        return False
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def run_cli():
    """Invoke `distsetup ARGS...` in-process; returns Click's Result (exit_code, stdout, stderr)."""
    runner = CliRunner()

    def run(*args, **kwargs):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False, **kwargs)

    return run


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real two-node SLURM cluster on loopback (tests/support/slurm_cluster.py), started once for every test."""
    if not slurm_available() or os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("SLURM tests must run in CI: install slurmctld slurmd slurm-client munge and run as root")
        pytest.skip("needs slurmctld, slurmd, munge and root")
    require_tool("shellcheck")
    c = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    c.start()
    yield c
    c.stop()


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder with a run config and a good DeepSpeed file; the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(RUN_CONFIG)
    (tmp_path / "good.json").write_text(json.dumps(DS_CONFIG))
    return tmp_path


_skipped_in_ci: list[str] = []


def pytest_runtest_logreport(report):
    if os.environ.get("CI") == "true" and report.skipped:
        _skipped_in_ci.append(f"{report.nodeid}: {report.longrepr[-1] if report.longrepr else ''}")


def pytest_sessionfinish(session, exitstatus):
    """In CI every test must run: a skip there (a missing DeepSpeed, SLURM, ...) fails the run."""
    if _skipped_in_ci and session.exitstatus == 0:
        print("\nTests skipped under CI (each must run there):\n  " + "\n  ".join(_skipped_in_ci))
        session.exitstatus = 1

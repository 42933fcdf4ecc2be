import ast
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from shell_checks import require_tool
from slurm_cluster import LocalSlurm, slurm_available

from distsetup.cli.main import cli

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
# Every process the tests start (torchrun, sbatch jobs, DeepSpeed's JIT builds) must find this
# interpreter's tools first: two ninja versions write incompatible build logs, and alternating between
# them recompiles DeepSpeed's CPU ops (30 s or more) on every run.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


@pytest.fixture
def run_cli():
    """Invoke `distsetup ARGS...` in-process; returns Click's Result (exit_code, stdout, stderr)."""
    runner = CliRunner()

    def run(*args, **kwargs):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False, **kwargs)

    return run


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real two-node SLURM cluster on loopback (tests/slurm_cluster.py), started once for every test."""
    if not slurm_available() or os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("SLURM tests must run in CI: install slurmctld slurmd slurm-client munge and run as root")
        pytest.skip("needs slurmctld, slurmd, munge and root")
    require_tool("shellcheck")
    c = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    c.start()
    yield c
    c.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_subprocess_cli(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """`python -m distsetup ARGS...` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "distsetup", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def heavy_imports(args: list[str], watched: tuple[str, ...], cwd=REPO) -> tuple[list[str], object]:
    """(the `watched` modules loaded, the exit code) after `distsetup ARGS` in a fresh interpreter."""
    code = (
        "import sys\nfrom distsetup.cli.main import cli\n"
        f"try:\n    cli({list(args)!r}, prog_name='distsetup')\nexcept SystemExit as e:\n    code = e.code\n"
        f"print(repr((sorted(m for m in {watched!r} if m in sys.modules), code)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stdout + out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


_skipped_in_ci: list[str] = []


def pytest_runtest_logreport(report):
    if os.environ.get("CI") == "true" and report.skipped:
        _skipped_in_ci.append(f"{report.nodeid}: {report.longrepr[-1] if report.longrepr else ''}")


def pytest_sessionfinish(session, exitstatus):
    """In CI every test must run: a skip there (a missing DeepSpeed, SLURM, ...) fails the run."""
    if _skipped_in_ci and session.exitstatus == 0:
        print("\nTests skipped under CI (each must run there):\n  " + "\n  ".join(_skipped_in_ci))
        session.exitstatus = 1

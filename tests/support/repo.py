"""The repository's paths, a free local port, and `distsetup` run in a fresh interpreter: what the tests share
besides conftest.py's fixtures (and the variable that names the folder of their shared runs)."""

import ast
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"  # these helpers, for a subprocess's PYTHONPATH
# the folder of the runs tests share, one for every pytest-xdist worker: conftest.py makes it, train_runs.py uses it
SHARED_RUNS_VARIABLE = "DISTSETUP_TEST_SHARED_RUNS"


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

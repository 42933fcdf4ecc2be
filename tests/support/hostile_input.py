"""What the hostile-input tests share: a run config, the one-line error check, a file's problems by key path, and
`distsetup` in a fresh interpreter held to 2 GiB and 30 s."""

import resource
import subprocess
import sys

import pytest
from repo import REPO

from distsetup.formats.validate import validate_file

RUN_CONFIG = "training: {micro_batch_size: 4}\ndistributed: {backend: ddp}\n"


def one_line_error(result, *words) -> str:
    """A single `Error: ...` line on stderr that holds every one of `words` (that line), and exit status 1, or 2
    where Click refused a flag or its value, as Click exits on a usage error (the line then names the --help that
    says what the command takes)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output, result.stderr
    assert result.exit_code == (2 if lines[0].endswith("--help` says what it takes.") else 1), result.output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def problems_of(path, **kwargs) -> dict:
    return {p.path: p for p in validate_file(path, **kwargs)[1]}


def fenced_cli(*args) -> subprocess.CompletedProcess:
    """`distsetup ARGS` in a fresh interpreter held to 2 GiB and 30 s: where the bug this guards against came
    back, a hang or a runaway allocation fails this test instead of taking the test run (or the machine) down."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    try:
        return subprocess.run(
            [sys.executable, "-m", "distsetup", *map(str, args)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            preexec_fn=limit_memory,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"distsetup {' '.join(map(str, args))} ran for 30 s")

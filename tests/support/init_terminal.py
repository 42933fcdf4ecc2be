"""`distsetup init` at a real pseudo-terminal (pexpect), and the files it leaves behind."""

import os
import signal
import sys
from pathlib import Path

import pexpect


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def environment() -> dict:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "200"}


def as_at_a_terminal() -> None:
    """In the child, before it runs: Ctrl-C interrupts it, as at a person's terminal, even where the tests run with
    SIGINT ignored (under nohup, or in a non-interactive shell's background job), which the child would inherit and
    Python would then keep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_init(folder: Path, *args: str) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable,
        ["-m", "distsetup", "init", *args],
        cwd=str(folder),
        env=environment(),
        encoding="utf-8",
        timeout=60,
        dimensions=(50, 200),
        preexec_fn=as_at_a_terminal,
    )

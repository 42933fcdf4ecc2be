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


def interrupt_at_the_prompt(child: pexpect.spawn, tries: int = 5) -> None:
    """Ctrl-C at the prompt the child has just printed, until it exits. Python's input() prints the prompt, then
    reads: a SIGINT between the two only sets a flag, and the read waits for a line (a CPython race: 4 hangs in 200
    tries of a bare input() on a busy machine). A person presses Ctrl-C again; so does this, at most `tries` times."""
    for _ in range(tries):
        child.sendintr()
        if child.expect([pexpect.EOF, pexpect.TIMEOUT], timeout=10) == 0:
            return
    raise AssertionError(f"{tries} Ctrl-Cs did not stop the child: {child.before!r}")


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

"""One run per output folder: rank 0 holds an exclusive lock on `output_dir/.lock` for the whole run.

Two runs writing into one folder would resume each other's checkpoints and mix their metrics. The lock is
an flock, which the kernel drops when its process ends however it ends, so a run killed with -9, preempted
or crashed leaves nothing stuck; the file keeps the holder's host and pid for the message a second run
prints. (On network file systems without flock support, each node's kernel still keeps two runs started on
the same node apart.)
"""

import fcntl
import os
import socket
import time
from pathlib import Path

from distsetup.errors import DistsetupError

LOCK_FILE = ".lock"


class OutputDirLock:
    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.fd: int | None = None

    def acquire(self) -> None:
        """Create the folder and take the lock, or fail in one line naming training.output_dir."""
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DistsetupError(
                f"training.output_dir {self.output_dir} cannot be used: {e.strerror} ({e.filename}).",
                "set training.output_dir to a folder you can write to.",
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DistsetupError(
                f"training.output_dir {self.output_dir} is in use by another run ({holder}).",
                "wait for that run to end, or give this one its own training.output_dir.",
            )
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, unlocked
            self.fd = None

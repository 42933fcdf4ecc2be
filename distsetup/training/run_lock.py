"""One run per output folder: rank 0 holds an exclusive lock on `output_dir/.lock` for the whole run.

Two runs writing into one folder would resume each other's checkpoints and mix their metrics. The lock is
an flock, which the kernel drops when its process ends however it ends, so a run killed with -9, preempted
or crashed leaves nothing stuck; the file keeps the holder's host and pid for the message a second run
prints. A file system without flock (Lustre mounted `noflock`, NFS without lockd) cannot be locked: the run
goes on and says so.
"""

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from distsetup.errors import DistsetupError

LOCK_FILE = ".lock"
NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)  # the file system has no flock


class OutputDirLock:
    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.fd: int | None = None
        self.unsupported: str | None = None  # why the folder could not be locked, where it cannot

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
        except OSError as e:
            if e.errno not in NO_LOCKS:
                os.close(fd)
                raise DistsetupError(
                    f"training.output_dir {self.output_dir}: cannot lock {LOCK_FILE} ({e.strerror}).",
                    "set training.output_dir to a folder on a local or shared disk you can write to.",
                )
            os.close(fd)  # a file system without locks (Lustre `noflock`, NFS without lockd): run unguarded
            self.unsupported = f"{self.output_dir} cannot be locked ({e.strerror}): nothing stops a second run there"
            return
        try:
            os.ftruncate(fd, 0)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}".encode())
        except OSError:
            pass  # the holder's name is a courtesy to a second run's message; the lock holds without it
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, unlocked
            self.fd = None

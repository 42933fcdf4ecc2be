"""Folders written whole under a hidden staging name (tempfile.mkdtemp beside them) and then renamed: mkdtemp makes
them owner-only (0700), which the renamed folder would keep, unreadable to the rest of a group sharing a cluster's
file system (an export, a token cache)."""

import os
import stat
from pathlib import Path


def as_a_new_folder(staging: Path) -> None:
    """Give `staging` the permissions `mkdir` would have given it under this process's umask, its parent's setgid
    bit (a group's shared folder) included."""
    inherited = staging.parent.stat().st_mode & stat.S_ISGID
    staging.chmod((0o777 & ~_umask()) | inherited)


def _umask() -> int:
    """This process's umask, read without setting it where Linux says it (/proc/self/status: another thread
    creating a file meanwhile would get a umask of 0)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)  # reading it means setting it: set back at once
    os.umask(mask)
    return mask

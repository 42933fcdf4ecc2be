"""Folders written whole under a hidden staging name (tempfile.mkdtemp beside them) and then renamed: mkdtemp makes
them owner-only (0700), which the renamed folder would keep, unreadable to the rest of a group sharing a cluster's
file system (an export, a token cache)."""

import os
from pathlib import Path


def as_a_new_folder(staging: Path) -> None:
    """Give `staging` the permissions `mkdir` would have given it under this process's umask."""
    staging.chmod(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)  # reading it means setting it: set back at once
    os.umask(mask)
    return mask

"""This checkout's wheel, as pip builds it (no dependencies, no build isolation)."""

import subprocess
import sys
from pathlib import Path

from repo import REPO


def build_wheel(folder: Path) -> Path:
    """Build the wheel into `folder`; its path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", folder, REPO],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = folder.glob("distsetup-*.whl")
    return built

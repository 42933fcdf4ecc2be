"""Shell-script checks shared by the launcher and SLURM tests: shellcheck, and the per-node srun program."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest


def require_tool(name: str) -> str:
    """The tool's path; in CI (CI=true) a missing tool fails the test instead of skipping it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is not installed; .ci/run installs it")
        pytest.skip(f"{name} is not installed")
    return path


def shellcheck(paths: list[Path]) -> None:
    """shellcheck every script (all severities); one call for many files."""
    require_tool("shellcheck")
    result = subprocess.run(["shellcheck", "--severity=style", "--format=gcc", *map(str, paths)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def srun_program(script: str) -> str:
    """The single-quoted program that `srun ... bash -c '...'` runs on each node, as a script of its own."""
    match = re.search(r"bash -c '\n(.*?)\n' distsetup-node ", script, re.S)
    assert match, "no srun bash -c program in the script"
    return "#!/bin/bash\n" + match.group(1) + "\n"

"""Shell-script checks shared by the launcher and SLURM tests: shellcheck, the per-node srun program, and
running a generated script with fake launchers that print what they were given."""

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
    result = subprocess.run(
        ["shellcheck", "--severity=style", "--format=gcc", *map(str, paths)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _srun_program_lines(script: str) -> str:
    match = re.search(r"bash -c '\n(.*?)\n' distsetup-node ", script, re.S)
    assert match, "no srun bash -c program in the script"
    return match.group(1) + "\n"


def srun_program(script: str) -> str:
    """The single-quoted program that `srun ... bash -c '...'` runs on each node, as a script of its own."""
    return "#!/bin/bash\n" + _srun_program_lines(script)


def job_shell(script: str) -> str:
    """The job script with the lines of its srun program left out: what its batch shell runs."""
    return script.replace(_srun_program_lines(script), "")


def fake_tools(tmp_path: Path, *names: str, show_env=()) -> Path:
    """A bin folder whose tools print the named environment variables, then their argv, one per line
    (a tool already written there, with a body of a test's own, is kept)."""
    fake = tmp_path / "fakebin"
    fake.mkdir(exist_ok=True)
    env_lines = "".join(f'echo "{name}=${{{name}:-<unset>}}"\n' for name in show_env)
    for name in (n for n in names if not (fake / n).exists()):
        (fake / name).write_text(f'#!/bin/bash\n{env_lines}printf "%s\\n" "$@"\n')
        (fake / name).chmod(0o755)
    return fake


def run_script(path_or_text, tmp_path: Path, *tools: str, env=None, show_env=(), args=(), cwd=None):
    """Run a generated script with fake launchers first on PATH; returns the CompletedProcess."""
    script = Path(path_or_text) if isinstance(path_or_text, Path) else tmp_path / "run.sh"
    if not isinstance(path_or_text, Path):
        script.write_text(path_or_text)
    fake = fake_tools(tmp_path, *(tools or ("torchrun",)), show_env=show_env)
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "NODE_RANK", "CUDA_VISIBLE_DEVICES")}
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {}), "PATH": f"{fake}:{os.environ['PATH']}"},
    )

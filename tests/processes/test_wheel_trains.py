"""A launcher script written by the installed wheel alone (no checkout, no src/train.py), in an empty folder,
trains on 2 CPU processes, and trains again when started from another folder."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from wheels import build_wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def wheel_venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (no deps); torch and the rest come from this test
    environment's site-packages, appended by a .pth file (a plain path: the editable install's own .pth
    there is not read, so `distsetup` can only come from the wheel). torchrun is written as pip writes it."""
    venv = tmp_path_factory.mktemp("wheel_venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "test_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    torchrun = (Path(sys.executable).parent / "torchrun").read_text().split("\n", 1)[1]
    (venv / "bin" / "torchrun").write_text(f"#!{python}\n{torchrun}")
    (venv / "bin" / "torchrun").chmod(0o755)
    return venv


def test_launcher_script_from_a_wheel_trains_from_any_folder(wheel_venv, tmp_path):
    """With only the wheel installed (no checkout, no src/train.py), in an empty folder, the generated script
    trains, and trains again when started from another folder."""
    bin_dir = wheel_venv / "bin"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PWD")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1")
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    where = subprocess.run(
        ["python", "-c", "import distsetup; print(distsetup.__file__)"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(wheel_venv)), where  # the wheel, not the editable checkout
    made = subprocess.run(
        ["distsetup", "launcher", "--num_gpus_per_node", "2", "-o", "run.sh"],  # no run config:
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # the defaults train
    assert made.returncode == 0, made.stderr
    assert "distsetup.train" in (project / "run.sh").read_text()
    for cwd, script, out in (
        (project, "run.sh", project / "out"),  # where it was written
        (elsewhere, str(project / "run.sh"), "out2"),
    ):  # from another folder
        run = subprocess.run(
            ["bash", script, "training.max_steps=5", f"training.output_dir={out}"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        summary = json.loads((project / out / "summary.json").read_text())  # relative: in the project
        assert (summary["steps"], summary["world_size"]) == (5, 2), summary
    assert not (elsewhere / "out2").exists()

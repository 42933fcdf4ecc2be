"""The installed wheel works on its own: schemas, templates and the trainer ship inside it."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, REPO],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = dist.glob("distsetup-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_site(wheel, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return wheel, site


def test_wheel_contains_schemas_and_templates(wheel_site):
    wheel, _ = wheel_site
    names = zipfile.ZipFile(wheel).namelist()
    assert "distsetup/formats/schemas/deepspeed.schema.json" in names
    assert "distsetup/formats/schemas/run_config.schema.json" in names
    templates = {n for n in names if n.startswith("distsetup/templates/")}
    shipped = {f"distsetup/templates/{p.name}" for p in (REPO / "templates").glob("*.j2")}
    assert shipped <= templates
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "distsetup").rglob("*.py")}
    assert modules - set(names) == set()  # every sub-package listed in setup.cfg


def test_installed_wheel_runs_outside_the_checkout(wheel_site, tmp_path):
    _, site = wheel_site
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import distsetup, distsetup.scripts.templating as t, sys; print(distsetup.__file__); print(t.templates_dir())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    module_file, templates = out.stdout.split()
    assert module_file.startswith(str(site)) and templates.startswith(str(site))
    result = subprocess.run(
        [sys.executable, "-m", "distsetup", "deepspeed", "--zero_stage", "3", "-o", "ds.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    check = subprocess.run(
        [sys.executable, "-m", "distsetup", "validate", "ds.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


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


@pytest.mark.slow
def test_launcher_script_from_a_wheel_trains_from_any_folder(wheel_venv, tmp_path):
    """Issue 11's proof: with only the wheel installed (no checkout, no src/train.py), in an empty folder, the
    generated script trains, and trains again when started from another folder."""
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


def test_ci_constraints_pin_every_declared_requirement_within_its_range():
    """requirements/constraints.txt (`make constraints`) pins what setup.cfg declares, inside the declared
    ranges: CI installs exactly these versions, users keep the ranges."""
    import configparser

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = {}
    for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    declared = setup["options"]["install_requires"].split() + [
        line for extra in ("train", "hf", "test", "lint") for line in setup["options.extras_require"][extra].split()
    ]
    for text in declared:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is declared in setup.cfg but not pinned: run `make constraints`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, str(pins[name]))
    assert str(pins["torch"]).endswith("+cpu"), "CI installs the CPU build of torch"

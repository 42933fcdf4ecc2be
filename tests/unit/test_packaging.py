"""The installed wheel works on its own: schemas and templates ship inside it, and it runs outside the
checkout. (A launcher script it writes, training from any folder: tests/processes/test_wheel_trains.py.)"""

import os
import subprocess
import sys
import zipfile

import pytest
from repo import REPO
from wheels import build_wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("dist"))


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
        line
        for extra in ("train", "hf", "test", "lint", "docs")
        for line in setup["options.extras_require"][extra].split()
    ]
    for text in declared:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is declared in setup.cfg but not pinned: run `make constraints`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, str(pins[name]))
    assert str(pins["torch"]).endswith("+cpu"), "CI installs the CPU build of torch"

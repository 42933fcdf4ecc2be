"""`make gpu-kit`: every wheel a lent GPU machine lacks to run distsetup's trainer and `make gpu-check`, in `.whl/`.

That machine has Python 3.12, torch with CUDA and the packages gpu/image.txt lists, and reaches no registry, so the
rest travels with the working tree as wheels (at most 64 MiB). The kit is resolved here, from distsetup's own
requirements (setup.cfg: install_requires and the train and gpu extras) down through each wheel's Requires-Dist,
leaving out what the image has, at the versions CI tests (requirements/constraints.txt). DeepSpeed comes as an sdist:
it is built here into a pure wheel (its ops compile on first use, there as here). The kit is then checked whole: every
requirement of every kit wheel met by the kit or the image, with the image's torch pinned; every wheel installable on
the target Python; the total under the limit.

    python gpu/kit.py                      # .whl/ for the GPU machine (cp312)
    python gpu/kit.py --python 3.11 --dest /tmp/kit   # the same pins for this interpreter (the dry run's kit)
"""

import argparse
import configparser
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
IMAGE = Path(__file__).resolve().parent / "image.txt"
CONSTRAINTS = REPO / "requirements" / "constraints.txt"
EXTRAS = ("train", "gpu")  # what the trainer and `distsetup status` import; the image has the test tier's pytest
BUILT_HERE = {"deepspeed"}  # published as an sdist only
LIMIT_BYTES = 64 * 2**20  # what the device tool carries to the GPU machine
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


class KitError(Exception):
    """What makes the kit unusable: said in one line, and `make gpu-kit` fails."""


def pinned(path: Path) -> dict[str, str]:
    """name -> version of each `name==version` line (pip-compile's output, gpu/image.txt); names canonical."""
    versions = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            versions[canonicalize_name(name)] = version.split("+", 1)[0] or ""  # 2.13.0+cpu: the release
    return versions


def root_requirements() -> list[Requirement]:
    """setup.cfg's install_requires and the EXTRAS: what distsetup itself needs to train on a GPU."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in EXTRAS:
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in lines if line.strip()]


def marker_environment(python: str) -> dict[str, str]:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def applies(requirement: Requirement, python: str) -> bool:
    return requirement.marker is None or requirement.marker.evaluate(marker_environment(python))


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist, from its METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(metadata).decode())
    return [Requirement(value) for value in message.get_all("Requires-Dist") or []]


def wheel_name(wheel: Path) -> str:
    return canonicalize_name(parse_wheel_filename(wheel.name)[0])


def fetch(names: list[str], versions: dict[str, str], python: str, dest: Path) -> None:
    """`names` at their pinned versions into `dest`: downloaded wheels for `python` on x86_64 Linux, or built here."""
    missing = [name for name in names if name not in versions]
    if missing:
        raise KitError(f"{', '.join(missing)} not pinned in {CONSTRAINTS.relative_to(REPO)}: run `make constraints`")
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    downloaded = [f"{name}=={versions[name]}" for name in names if name not in BUILT_HERE]
    if downloaded:
        platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
        target = ["--python-version", python, "--implementation", "cp", *platforms]
        run([*pip, "download", "--no-deps", "--only-binary=:all:", *target, "-d", str(dest), *downloaded])
    for name in sorted(set(names) & BUILT_HERE):  # pure wheels whatever the Python
        run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), f"{name}=={versions[name]}"])


def run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "error" in line]
        raise KitError(f"{' '.join(argv[3:6])} ... failed: {(errors or result.stderr.splitlines() or ['?'])[-1]}")


def build_kit(dest: Path, python: str) -> list[Path]:
    """Resolve and fetch the kit into `dest` (emptied of wheels first): distsetup's requirements, then each fetched
    wheel's, until every one is met by the image or the kit."""
    image, versions = pinned(IMAGE), pinned(CONSTRAINTS)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    wanted = {canonicalize_name(r.name) for r in root_requirements() if applies(r, python)} - set(image)
    fetched: set[str] = set()
    while wanted - fetched:
        fetch(sorted(wanted - fetched), versions, python, dest)
        fetched |= wanted
        for wheel in dest.glob("*.whl"):
            needs = {canonicalize_name(r.name) for r in wheel_requirements(wheel) if applies(r, python)}
            wanted |= needs - set(image)
    wheels = sorted(dest.glob("*.whl"))
    check_kit(wheels, python)
    return wheels


def check_kit(wheels: list[Path], python: str) -> None:
    """Raise KitError unless the kit is whole: one wheel per name, each installable on `python` (x86_64 Linux), every
    requirement (distsetup's and each wheel's) met by the kit or the image at a version it allows, within the limit."""
    image = pinned(IMAGE)
    kit: dict[str, str] = {}
    for wheel in wheels:
        name, version = wheel_name(wheel), str(parse_wheel_filename(wheel.name)[1])
        if name in kit:
            raise KitError(f"two wheels of {name} in the kit ({kit[name]}, {version}): pip would refuse both")
        kit[name] = version
        if not installable(wheel, python):
            raise KitError(f"{wheel.name} does not install on CPython {python} for x86_64 Linux")
    requirements = [("distsetup", r) for r in root_requirements()]
    requirements += [(wheel.name, r) for wheel in wheels for r in wheel_requirements(wheel)]
    for needed_by, requirement in requirements:
        if not applies(requirement, python):
            continue
        name = canonicalize_name(requirement.name)
        version = kit.get(name, image.get(name))
        if version is None:
            raise KitError(f"{requirement} (needed by {needed_by}) is neither in the kit nor in {IMAGE.name}")
        if version and not SpecifierSet(str(requirement.specifier)).contains(version, prereleases=True):
            raise KitError(f"{requirement} (needed by {needed_by}) is not met by {name} {version}")
    size = sum(wheel.stat().st_size for wheel in wheels)
    if size > LIMIT_BYTES:
        raise KitError(
            f"the kit is {size / 2**20:.1f} MiB, over the {LIMIT_BYTES // 2**20} MiB the device tool carries"
        )


def installable(wheel: Path, python: str) -> bool:
    """Whether one of the wheel's tags is one that pip on CPython `python`, x86_64 manylinux, accepts."""
    major, minor = (int(part) for part in python.split("."))
    platforms = PLATFORMS + ["linux_x86_64"]
    accepted: set[Tag] = set(cpython_tags((major, minor), platforms=platforms))
    accepted |= set(compatible_tags((major, minor), f"cp{major}{minor}", platforms=platforms))
    return bool(set(parse_wheel_filename(wheel.name)[3]) & accepted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    a = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", a.python):
        parser.error(f"--python {a.python}: give a version such as 3.12")
    try:
        wheels = build_kit(a.dest, a.python)
    except KitError as e:
        print(f"error: gpu kit: {e}", file=sys.stderr)
        return 1
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(f"{len(wheels)} wheels for CPython {a.python}, {size / 2**20:.1f} MiB, in {a.dest}:")
    for wheel in wheels:
        print(f"  {wheel.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

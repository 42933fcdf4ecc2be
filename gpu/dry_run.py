"""`make gpu-check-dry OUT=folder`: gpu/check.py as the GPU machine would run it, here on the CPU (GPU_CHECK_DRY=1).

What it stands in for the GPU machine: an interpreter that sees only the packages gpu/image.txt lists (linked from
this virtual environment, whose torch stands in for the image's), and the kit built with the same pins for this
interpreter (gpu/kit.py --python X.Y), installed by the check itself with --no-index into a --target folder. So a
package the trainer or the GPU tier needs that is neither in the image nor in the kit fails here, every day, and not in
the GPU machine's few minutes.
"""

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from kit import IMAGE, build_kit, pinned
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "gpu" / "check.py"


def image_stand_in(folder: Path) -> Path:
    """A virtual environment without site packages whose path holds links to this environment's copies of the
    image's packages, and nothing else; returns its python."""
    env, packages = folder / "env", folder / "image-packages"
    venv.EnvBuilder(clear=True, with_pip=False, symlinks=True).create(env)
    packages.mkdir(parents=True, exist_ok=True)
    image = set(pinned(IMAGE))
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in image:
            continue
        site = Path(str(dist.locate_file("")))
        tops = {Path(str(file)).parts[0] for file in dist.files or [] if not str(file).startswith("..")}
        for top in tops - {"__pycache__"}:
            link = packages / top
            if not link.exists() and (site / top).exists():
                link.symlink_to(site / top)
    python = env / "bin" / "python"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (env / "lib" / version / "site-packages" / "image.pth").write_text(f"{packages}\n")
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the check's folder (gpu_check.json, gpu_check.log)")
    a = parser.parse_args(argv)
    out = a.out.resolve()
    kit = out / "wheels"
    build_kit(kit, f"{sys.version_info.major}.{sys.version_info.minor}")
    # outside `out`, which may hold a space: torch's extension builds (DeepSpeed's ops) cannot link a torch there
    stand_in = Path(tempfile.mkdtemp(prefix="gpu-check-stand-in-"))
    try:
        python = image_stand_in(stand_in)
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["GPU_CHECK_DRY"] = "1"
        # DeepSpeed's CPU ops built for the kit's DeepSpeed, in a folder of their own: built where this environment's
        # are, they would replace those (their flags name other paths), which every later run here would build again
        env["TORCH_EXTENSIONS_DIR"] = str(Path(env.get("TORCH_EXTENSIONS_DIR", REPO / ".torch_extensions")) / "dry-run")
        return subprocess.run([str(python), str(CHECK), str(out), "--kit", str(kit)], env=env).returncode
    finally:
        shutil.rmtree(stand_in, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

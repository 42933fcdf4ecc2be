"""Golden files for rendered scripts: compare, show a diff on mismatch, regenerate on purpose.

UPDATE_GOLDEN=1 .venv/bin/python -m pytest -k golden \
    tests/unit/test_launcher_golden_and_shellcheck.py tests/unit/test_slurm_script.py
"""

import difflib
import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
        return
    if not path.exists():
        raise AssertionError(f"golden file {path} is missing; create it with UPDATE_GOLDEN=1")
    expected = path.read_text()
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"golden/{name}",
                tofile="rendered",
            )
        )
        raise AssertionError(f"{name} differs from its golden file (UPDATE_GOLDEN=1 regenerates it):\n{diff}")

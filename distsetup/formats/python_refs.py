"""The user's code a run config names as `module:function` (model.builder, data.builder, data.collate,
training.loss): how such a name is written, and where its module is looked for (the run config's folder first,
then PYTHONPATH), checked without importing it: checking a file runs none of the user's code (nor torch)."""

import importlib.machinery
import re
import sys
from pathlib import Path

from distsetup.formats.problems import Problem

REFERENCE = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def split(reference: str) -> tuple[str, str] | None:
    """("module", "function") of "module:function" (dotted names allowed on both sides); None if not so written."""
    match = REFERENCE.fullmatch(reference.strip())
    return (match["module"], match["function"]) if match else None


def search_path(base_dir: Path | None) -> list[str]:
    """Where a named module is looked for: the run config's folder, then the interpreter's path (PYTHONPATH)."""
    return [str(base_dir or Path.cwd()), *sys.path]


def problems(reference: str, where: str, role: str, base_dir: Path | None) -> list[Problem]:
    """What is wrong with `reference` (the function that does `role`, at run-config key `where`)."""
    parts = split(reference)
    if parts is None:
        return [
            Problem(
                where,
                f"{reference!r} is not written module:function.",
                f"name the function that {role}, "
                "e.g. scorer:build_model for build_model in scorer.py next to the run config.",
            )
        ]
    top = parts[0].split(".")[0]
    if importlib.machinery.PathFinder.find_spec(top, search_path(base_dir)) is None and top not in sys.modules:
        folder = base_dir or Path.cwd()
        return [
            Problem(
                where,
                f"module {top} is neither in the run config's folder ({folder}) nor on PYTHONPATH.",
                f"put {top}.py next to the run config, or add its folder to PYTHONPATH.",
            )
        ]
    return []

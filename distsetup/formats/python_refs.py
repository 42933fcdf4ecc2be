"""The user's code a run config names as `module:function` (model.builder, data.builder, data.collate,
training.loss): how such a name is written, and where its module is looked for (the run config's folder first,
then the working folder and PYTHONPATH), checked without importing it: checking a file runs none of the user's
code (nor torch)."""

import importlib.machinery
import re
import sys
from pathlib import Path

from distsetup.formats import module_source
from distsetup.formats.problems import Problem

REFERENCE = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def split(reference: str) -> tuple[str, str] | None:
    """("module", "function") of "module:function" (dotted names allowed on both sides); None if not so written."""
    match = REFERENCE.fullmatch(reference.strip())
    return (match["module"], match["function"]) if match else None


def search_path(base_dir: Path | None) -> list[str]:
    """Where a named module is looked for: the run config's folder, the working folder (`python -m
    distsetup.train` has it on its path, and the scripts run the trainer in the folder they were written in), then
    the interpreter's path (PYTHONPATH)."""
    return [str(base_dir or Path.cwd()), str(Path.cwd()), *sys.path]


def problems(reference: str, where: str, role: str, base_dir: Path | None, args: dict | None = None) -> list[Problem]:
    """What is wrong with `reference` (the function that does `role`, at run-config key `where`, called with the
    keyword arguments `args` where given): its form, its module, and as far as the module's source says without
    running it (module_source.py), the function and its parameters."""
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
    spec = importlib.machinery.PathFinder.find_spec(top, search_path(base_dir))
    if spec is None and top not in sys.modules:
        folders = dict.fromkeys([str(base_dir or Path.cwd()), str(Path.cwd())])  # one, where they are the same
        return [
            Problem(
                where,
                f"module {top} is not in the run config's folder or the working folder ({', '.join(folders)}), "
                "nor on PYTHONPATH.",
                f"put {top}.py next to the run config, or add its folder to PYTHONPATH.",
            )
        ]
    if spec is None or parts[0] != top or "." in parts[1] or not (spec.origin or "").endswith(".py"):
        return []  # a package's module, a method, compiled code: the run's import says
    return module_source.problems(Path(str(spec.origin)), top, parts[1], where, args)

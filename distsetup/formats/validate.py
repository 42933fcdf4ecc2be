"""`distsetup validate`: find a config file's kind and every problem in it."""

import shlex
from pathlib import Path
from typing import NamedTuple

from distsetup.errors import DistsetupError
from distsetup.formats.deepspeed import deepspeed_problems
from distsetup.formats.fsdp import fsdp_problems
from distsetup.formats.problems import Problem
from distsetup.formats.reading import duplicate_key_problems, read_json, read_yaml
from distsetup.formats.runconfig import config_problems, resolve_config_path

KINDS = ("deepspeed", "fsdp", "run_config")


def detect_kind(path: Path, data: dict) -> str:
    if path.suffix in (".yaml", ".yml"):
        return "run_config"
    if any(k.startswith("fsdp_") for k in data):
        return "fsdp"
    return "deepspeed"


class Validated(NamedTuple):
    kind: str
    problems: list[Problem]
    data: dict  # as read


def validate_file(path: Path, kind: str | None = None, world_size: int | None = None, hf: bool = False) -> Validated:
    """The kind, problems and data of a DeepSpeed JSON, an FSDP JSON or a run config YAML."""
    if kind == "run_config" or (kind is None and path.suffix in (".yaml", ".yml")):
        raw = read_yaml(path)
        problems = config_problems(raw, path.parent)
        return Validated("run_config", problems + _referenced_file_problems(raw, path.parent, world_size, hf), raw)
    data = read_json(path)
    kind = kind or detect_kind(path, data)
    problems = duplicate_key_problems(data)
    problems += deepspeed_problems(data, world_size, hf) if kind == "deepspeed" else fsdp_problems(data)
    return Validated(kind, problems, data)


def read_valid(path: str | Path, kind: str, world_size: int | None = None, hf: bool = False) -> dict:
    """For commands and the trainer that use a file: its data, or in one line the first problem `distsetup
    validate` would report (the same checks through validate_file, so a file is never accepted here and
    flagged there)."""
    _, problems, data = validate_file(Path(path), kind, world_size, hf)
    if problems:
        command = [
            "distsetup",
            "validate",
            str(path),
            *(["--world_size", str(world_size)] if world_size else []),
            *(["--hf"] if hf else []),
        ]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DistsetupError(f"{path}: {problems[0]}{more}", f"`{shlex.join(command)}` lists every problem.")
    return data


def _referenced_file_problems(raw: dict, base_dir: Path, world_size: int | None, hf: bool) -> list[Problem]:
    """Problems in the DeepSpeed/FSDP files a run config points at, prefixed with the config key."""
    problems = []
    distributed = raw.get("distributed")
    for key, kind in (("deepspeed_config", "deepspeed"), ("fsdp_config", "fsdp")):
        value = distributed.get(key) if isinstance(distributed, dict) else None
        if not isinstance(value, str) or not value.strip():
            continue
        target = resolve_config_path(value, base_dir)
        if target.exists():
            try:
                found = validate_file(target, kind, world_size, hf).problems
            except DistsetupError as e:  # unreadable: one problem, and the run config's others still listed
                problems.append(Problem(f"distributed.{key}", e.message, "give the file itself."))
                continue
            problems += [Problem(f"distributed.{key} -> {p.path}", p.message, p.fix) for p in found]
    return problems

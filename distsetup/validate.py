"""`distsetup validate`: find a config file's kind and every problem in it."""

import json
import shlex
from pathlib import Path

from distsetup.checks import deepspeed_problems, fsdp_problems
from distsetup.errors import DistsetupError
from distsetup.problems import TOO_DEEP, Problem, TooComplex, check_shape, join_path, read_config_text, too_complex
from distsetup.runconfig import config_problems, read_yaml, resolve_config_path

KINDS = ("deepspeed", "fsdp", "run_config")


class _KeysSeenTwice(dict):
    """A JSON object that remembers which of its keys appeared more than once."""

    duplicates: list[str]


def _object_with_duplicates(pairs):
    obj = _KeysSeenTwice()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def duplicate_key_problems(data, path=()) -> list[Problem]:
    problems = []
    if isinstance(data, _KeysSeenTwice):
        problems += [
            Problem(
                join_path(path + (k,)),
                f"key '{k}' appears more than once; only the last one counts.",
                "keep one of them.",
            )
            for k in data.duplicates
        ]
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in children:
        problems += duplicate_key_problems(value, path + (key,))
    return problems


def read_json(path: Path) -> dict:
    """A JSON config file as a dict, read within the limits of problems.read_config_text and check_shape.
    NaN and Infinity are read as floats: schema_problems reports them with their key path."""
    text = read_config_text(path, "JSON file")
    try:
        data = json.loads(text, object_pairs_hook=_object_with_duplicates)
        check_shape(data)
    except RecursionError:
        raise too_complex(path, "JSON file", TooComplex(TOO_DEEP))
    except TooComplex as e:
        raise too_complex(path, "JSON file", e)
    except json.JSONDecodeError as e:
        raise DistsetupError(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}.",
            "fix the JSON syntax (no comments or trailing commas).",
        )
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DistsetupError(f"{path} is not valid JSON: {str(e).split(';')[0]}.", "write the numbers a config needs.")
    if not isinstance(data, dict):
        raise DistsetupError(f"{path} must hold a JSON object.", "wrap the settings in { }.")
    return data


def detect_kind(path: Path, data: dict) -> str:
    if path.suffix in (".yaml", ".yml"):
        return "run_config"
    if any(k.startswith("fsdp_") for k in data):
        return "fsdp"
    return "deepspeed"


def validate_file(
    path: Path, kind: str | None = None, world_size: int | None = None, hf: bool = False
) -> tuple[str, list[Problem]]:
    """(kind, problems) for a DeepSpeed JSON, an FSDP JSON or a run config YAML."""
    if kind == "run_config" or (kind is None and path.suffix in (".yaml", ".yml")):
        raw = read_yaml(path)
        problems = config_problems(raw, path.parent)
        return "run_config", problems + _referenced_file_problems(raw, path.parent, world_size, hf)
    data = read_json(path)
    kind = kind or detect_kind(path, data)
    problems = duplicate_key_problems(data)
    problems += deepspeed_problems(data, world_size, hf) if kind == "deepspeed" else fsdp_problems(data)
    return kind, problems


def refuse_problems(path: str | Path, kind: str, world_size: int | None = None, hf: bool = False) -> None:
    """For commands that use a file: refuse what `distsetup validate` would report, in one line with the first
    problem (the same checks through validate_file, so a file is never accepted here and flagged there)."""
    _, problems = validate_file(Path(path), kind, world_size, hf)
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
                _, found = validate_file(target, kind, world_size, hf)
            except DistsetupError as e:  # unreadable: one problem, and the run config's others still listed
                problems.append(Problem(f"distributed.{key}", e.message, "give the file itself."))
                continue
            problems += [Problem(f"distributed.{key} -> {p.path}", p.message, p.fix) for p in found]
    return problems

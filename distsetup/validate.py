"""`distsetup validate`: find a config file's kind and every problem in it."""

import json
from pathlib import Path

from distsetup.checks import deepspeed_problems, fsdp_problems
from distsetup.errors import DistsetupError
from distsetup.problems import Problem, join_path
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
        problems += [Problem(join_path(path + (k,)), f"key '{k}' appears more than once; only the last one counts.",
                             "keep one of them.") for k in data.duplicates]
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in children:
        problems += duplicate_key_problems(value, path + (key,))
    return problems


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_object_with_duplicates)
    except OSError as e:
        raise DistsetupError(f"cannot read {path}: {e.strerror}.", "check the path.")
    except UnicodeDecodeError:
        raise DistsetupError(f"{path} is not UTF-8 text.", "give the JSON config file itself.")
    except json.JSONDecodeError as e:
        raise DistsetupError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}.",
                             "fix the JSON syntax (no comments or trailing commas).")
    if not isinstance(data, dict):
        raise DistsetupError(f"{path} must hold a JSON object.", "wrap the settings in { }.")
    return data


def detect_kind(path: Path, data: dict) -> str:
    if path.suffix in (".yaml", ".yml"):
        return "run_config"
    if any(k.startswith("fsdp_") for k in data):
        return "fsdp"
    return "deepspeed"


def validate_file(path: Path, kind: str | None = None, world_size: int | None = None,
                  hf: bool = False) -> tuple[str, list[Problem]]:
    """(kind, problems) for a DeepSpeed JSON, an FSDP JSON or a run config YAML."""
    if path.suffix in (".yaml", ".yml") or kind == "run_config":
        raw = read_yaml(path)
        problems = config_problems(raw, path.parent)
        return "run_config", problems + _referenced_file_problems(raw, path.parent, world_size, hf)
    data = read_json(path)
    kind = kind or detect_kind(path, data)
    problems = duplicate_key_problems(data)
    problems += deepspeed_problems(data, world_size, hf) if kind == "deepspeed" else fsdp_problems(data)
    return kind, problems


def _referenced_file_problems(raw: dict, base_dir: Path, world_size: int | None, hf: bool) -> list[Problem]:
    """Problems in the DeepSpeed/FSDP files a run config points at, prefixed with the config key."""
    problems = []
    for key, kind in (("deepspeed_config", "deepspeed"), ("fsdp_config", "fsdp")):
        value = (raw.get("distributed") or {}).get(key)
        if not isinstance(value, str):
            continue
        target = resolve_config_path(value, base_dir)
        if target.exists():
            _, found = validate_file(target, kind, world_size, hf)
            problems += [Problem(f"distributed.{key} -> {p.path}", p.message, p.fix) for p in found]
    return problems

"""`distsetup validate`: find a config file's kind and every problem in it."""

import copy
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from distsetup.errors import DistsetupError
from distsetup.formats.accelerate import accelerate_problems
from distsetup.formats.deepspeed_notes import accelerate_auto_notes, bent_settings_notes, deepspeed_notes
from distsetup.formats.deepspeed_rules import deepspeed_problems
from distsetup.formats.file_kinds import content_kind, wrong_kind_problem
from distsetup.formats.fsdp import FsdpSpec, reader_notes
from distsetup.formats.fsdp_rules import fsdp_findings
from distsetup.formats.hf_trainer import Context, TrainerValues, filled_in, mismatch_problems
from distsetup.formats.problems import Problem
from distsetup.formats.reading import (
    DEEPSPEED_REFUSES_IT,
    LAST_ONE_COUNTS,
    duplicate_key_problems,
    read_json,
    read_yaml,
)
from distsetup.formats.runconfig import RunConfig, resolve_config_path
from distsetup.formats.runconfig_load import apply_overrides, check_run_config, run_config_from
from distsetup.formats.settle import Settled, settle

KINDS = ("deepspeed", "fsdp", "run_config", "accelerate", "training_args")
YAML_SUFFIXES = (".yaml", ".yml")


def detect_kind(path: Path, data: dict) -> str:
    """The kind a file is read as: Accelerate's and TrainingArguments by their keys, else a run config in YAML, an
    FSDP file by its keys, a DeepSpeed file otherwise (whose rules say what is wrong with anything else)."""
    found = content_kind(data)
    if found in ("accelerate", "training_args"):
        return found
    if path.suffix in YAML_SUFFIXES:
        return "run_config"
    return "fsdp" if found == "fsdp" else "deepspeed"


class Validated(NamedTuple):
    kind: str
    problems: list[Problem]
    data: dict  # as read
    notes: list[str] = []  # how it was read: other tools' names, settings no reader uses


def validate_file(
    path: Path,
    kind: str | None = None,
    world_size: int | None = None,
    hf: bool = False,
    num_gpus_per_node: int | None = None,
    overrides: Sequence[str] = (),
) -> Validated:
    """The kind, problems and data of a DeepSpeed JSON, an FSDP JSON, a run config YAML (with `overrides`, the
    trainer's section.key=value), an Accelerate config or TrainingArguments saved as JSON/YAML (with the DeepSpeed
    file either names)."""
    as_yaml = path.suffix in YAML_SUFFIXES or kind == "run_config"
    data = read_yaml(path) if as_yaml else read_json(path)
    kind = kind or detect_kind(path, data)
    if as_yaml and kind in ("accelerate", "training_args"):
        data = read_yaml(path, as_pyyaml=True)  # as Accelerate and HfArgumentParser read it: 3e-5 is text there
    if kind == "run_config":
        given = apply_overrides(copy.deepcopy(data), list(overrides)) if overrides else data
        raw = copy.deepcopy(given)  # `data` stays as the file has it; `raw` is read into distsetup's keys
        checked = check_run_config(raw, path.parent)
        problems = checked.problems + _referenced_file_problems(given, path.parent, world_size, hf)
        notes = checked.notes
        if not problems:
            settled = settle_run_config(run_config_from(raw, checked), path.parent, world_size, hf)
            problems, notes = settled.problems, notes + settled.notes
        return Validated(kind, problems, data, notes)
    if kind in ("deepspeed", "fsdp") and (other_kind := wrong_kind_problem(data, kind)):
        return Validated(kind, [other_kind], data)
    what_it_does = DEEPSPEED_REFUSES_IT if kind == "deepspeed" else LAST_ONE_COUNTS
    problems = [] if as_yaml else duplicate_key_problems(data, what_it_does=what_it_does)
    if kind == "accelerate":
        # the file says how many machines: --num_gpus_per_node sets the world (num_machines x it), else --world_size
        problems += accelerate_problems(data, num_gpus_per_node, None if num_gpus_per_node else world_size)
        block = data.get("deepspeed_config")
        named = block.get("deepspeed_config_file") if isinstance(block, dict) else None
        world = data.get("num_processes") if isinstance(data.get("num_processes"), int) else world_size
        # Accelerate fills "auto" (batch sizes from the dataloader, precision from its own setting) as the Trainer does
        problems += _named_deepspeed_problems(named, path.parent, "deepspeed_config.deepspeed_config_file", world, None)
    elif kind == "training_args":
        wrong = TrainerValues.type_problems(data)
        # what the Trainer computes from a value of the wrong type is unknown: compare once the types are right
        trainer = None if wrong else TrainerValues.from_dict(data)
        named = _named_deepspeed_problems(data.get("deepspeed"), path.parent, "deepspeed", world_size, trainer)
        problems += wrong + named + _named_fsdp_problems(data.get("fsdp_config"), path.parent)
    elif kind == "deepspeed":
        # a file for distsetup's trainer may leave the batch to the run config; one for the HF Trainer may not
        problems += deepspeed_problems(data, world_size, hf, batch_elsewhere=not hf)
        notes = (accelerate_auto_notes(data) if hf else deepspeed_notes(data)) + bent_settings_notes(data)
        return Validated(kind, problems, data, notes)
    else:
        found, said = fsdp_findings(data, hf_trainer=hf)
        return Validated(kind, problems + found, data, said + reader_notes(data))
    return Validated(kind, problems, data)


def _named_fsdp_problems(named, base_dir: Path) -> list[Problem]:
    """Problems in the FSDP settings TrainingArguments name (a file, or a mapping written in place), as the HF
    Trainer reads them, prefixed with the key."""
    if isinstance(named, dict):
        return _prefixed("fsdp_config (written in place)", fsdp_findings(named, hf_trainer=True)[0])
    if not isinstance(named, str) or not named.strip():
        return []
    try:
        found = validate_file(resolve_config_path(named, base_dir), "fsdp", hf=True).problems
    except DistsetupError as e:
        return [Problem("fsdp_config", e.message, "give an existing FSDP JSON file.")]
    return _prefixed("fsdp_config", found)


def _named_deepspeed_problems(
    named, base_dir: Path, key: str, world_size: int | None, trainer: TrainerValues | None
) -> list[Problem]:
    """Problems in the DeepSpeed file an Accelerate config or TrainingArguments names (`key`; TrainingArguments also
    take its settings written in place, a mapping), prefixed with the key; with TrainingArguments also the values the
    HF Trainer would find mismatched."""
    if isinstance(named, dict) and trainer is not None:
        config, where = named, f"{key} (written in place)"
        found = duplicate_key_problems(config) + deepspeed_problems(config, world_size, hf=True)
    elif isinstance(named, str) and named.strip():
        target = resolve_config_path(named, base_dir)
        try:
            _, found, config, _ = validate_file(target, "deepspeed", world_size, hf=True)
        except DistsetupError as e:
            return [Problem(key, e.message, "give an existing DeepSpeed JSON file.")]
        where = str(target)
    else:
        return []
    if trainer is not None:
        context = Context(world_size=world_size)
        found += mismatch_problems(config, trainer, context, where)
        # the rules again on what DeepSpeed gets (fp16 "auto" made true by TrainingArguments at stage 0, say)
        said = {(p.path, p.message) for p in found}
        found += [
            Problem(p.path, f'{p.message.rstrip(".")} (with the values TrainingArguments put in its "auto").', p.fix)
            for p in deepspeed_problems(filled_in(config, trainer, context), world_size, hf=True)
            if (p.path, p.message) not in said
        ]
    return _prefixed(key, found)


def _prefixed(key: str, problems: list[Problem]) -> list[Problem]:
    """Problems of a file another file names under `key`, said as `key -> path`."""
    return [Problem(f"{key} -> {p.path}", p.message, p.fix) for p in problems]


def read_valid(path: str | Path, kind: str, world_size: int | None = None, hf: bool = False) -> dict:
    """For commands and the trainer that use a file: its data, or in one line the first problem `distsetup
    validate` would report (the same checks through validate_file, so a file is never accepted here and
    flagged there)."""
    _, problems, data, _ = validate_file(Path(path), kind, world_size, hf)
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


def settle_run_config(cfg: RunConfig, base_dir: Path | None, world_size: int | None, hf: bool = False) -> Settled:
    """settle() of a valid run config and its backend's settings, read as the trainer reads them: the DeepSpeed file
    (refused in one line where `distsetup validate` finds a problem), the inline FSDP settings or the FSDP file."""
    cfg = cfg.resolved(base_dir)
    dist = cfg.distributed
    if dist.backend == "deepspeed" and dist.deepspeed_config:
        deepspeed = read_valid(dist.deepspeed_config, "deepspeed", world_size, hf)
        return settle(cfg, deepspeed, None, world_size, f"DeepSpeed file {dist.deepspeed_config}")
    return settle(cfg, None, read_fsdp_settings(cfg) if dist.backend == "fsdp" else None, world_size)


def read_fsdp_settings(cfg: RunConfig) -> FsdpSpec:
    """The FSDP settings written inline under `distributed:` (checked with the run config), else the FSDP file."""
    inline = cfg.distributed.fsdp
    return FsdpSpec.from_dict(inline) if inline else read_fsdp_file(cfg.distributed.fsdp_config)


def read_fsdp_file(path: str | None) -> FsdpSpec:
    """The FSDP file as a spec (the defaults for what it leaves out); none at all: full shard of each block."""
    if not path:
        return FsdpSpec()
    spec = FsdpSpec.from_dict(read_valid(path, "fsdp"))
    if spec.fsdp_version != 2:
        raise DistsetupError(
            f"{path} is an FSDP1 file; distsetup's trainer runs FSDP2 (fully_shard).",
            "regenerate it with `distsetup fsdp --fsdp_version 2`.",
        )
    return spec


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
            problems += _prefixed(f"distributed.{key}", found)
    return problems

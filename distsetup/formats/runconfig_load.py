"""Reading a run config: the file and its `section.key=value` overrides, checked strictly (keys that are not names,
other tools' names and older spellings read as distsetup's, the schema, what the schema cannot say, then the rules
across fields) and built into a RunConfig."""

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from distsetup.errors import DistsetupError
from distsetup.formats.default_paths import BACKEND_FILES
from distsetup.formats.file_kinds import wrong_kind_problem
from distsetup.formats.fsdp_inline import inline_findings, read_inline
from distsetup.formats.other_names import OWN_KEY_FORMS, hint, read_other_names, sets_something, spellings
from distsetup.formats.problems import Problem, join_path, schema_problems
from distsetup.formats.reading import parse_yaml, read_yaml
from distsetup.formats.runconfig import SECTIONS, DistributedConfig, ModelConfig, RunConfig
from distsetup.formats.runconfig_rules import cross_field_problems, step_count_problems


@dataclass
class Checked:
    """What checking a raw run config found: its problems, the notes on how it was read, the keys it sets."""

    problems: list[Problem]
    notes: list[str]
    written: dict[str, str]  # as RunConfig.written


def load_run_config(
    path: str | Path | None, overrides: Sequence[str] = (), not_needed: Sequence[str] = ()
) -> RunConfig:
    """Read config.yaml (or the defaults when path is None), apply overrides, and check it all but the keys
    `not_needed` (what the command does not read)."""
    raw = read_run_config(Path(path)) if path else {}
    file_sections = set(raw)
    raw = apply_overrides(raw, list(overrides))
    checked = check_run_config(raw, Path(path).parent if path else None)
    problems = [problem for problem in checked.problems if problem.path not in not_needed]
    if problems:
        where = _where(problems[0], path, overrides, file_sections)
        raise DistsetupError(
            f"run config problem{where}: {problems[0]}"
            + (f" (and {len(problems) - 1} more; run `distsetup validate`)" if len(problems) > 1 else "")
        )
    return run_config_from(raw, checked)


def read_run_config(path: Path) -> dict:
    """A run config file as a dict, refused in one line where it is a config of another kind (said before the
    overrides or flags add sections of a run config to it)."""
    raw = read_yaml(path)
    wrong = wrong_kind_problem(raw, "run_config")
    if wrong:
        raise DistsetupError(f"{path}: {wrong.message}", wrong.fix)
    return raw


def _where(problem: Problem, path: str | Path | None, overrides: Sequence[str], file_sections: set) -> str:
    """Where the user wrote what `problem` is about: the command line's override of its key, of a key inside it or
    around it, of a section the file has not (`trainig.lr=...`), or of another key its rule involves; else the
    file (its top-level keys: `file_sections`)."""
    keys = (problem.path, *problem.involves)
    for item in reversed(overrides):  # the last override of a key is the one that counts
        dotted = item.partition("=")[0]
        # below a section, an override of a key inside the one at fault is that problem's too (model.args.x)
        if any(
            _nested(key, dotted) or (("." in key or key not in file_sections) and _nested(dotted, key))
            for key in keys
            if key
        ):
            return f" in the override {item}"
    return f" in {path}" if path else ""


def _nested(inner: str, outer: str) -> bool:
    """Whether key path `inner` is `outer` or lies inside it (an item of its list, a key of its mapping)."""
    return inner == outer or inner.startswith((outer + ".", outer + "["))


# The run's length is one or the other (the HF Trainer's name for epochs too): an override of one replaces what the file
# sets of the other (the command line wins, as for every key), so that `training.epochs=3` runs on a config.yaml that
# sets max_steps
RUN_LENGTH = ({"epochs", "num_train_epochs"}, {"max_steps"})


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` overrides (values parsed as YAML) to a raw config dict; `section.key.inner=value`
    sets one key inside a mapping (model.args.experts=64), the rest of it kept."""
    overridden = {item.partition("=")[0] for item in overrides}
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, *keys = dotted.split(".")
        if not (sep and keys and all(keys)):
            raise DistsetupError(
                f"override '{item}' is not of the form section.key=value.", "write e.g. training.lr=3e-4"
            )
        if raw.get(section) is None:  # absent, or written empty (`model:`)
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise DistsetupError(
                f"override '{item}': '{section}' is not a section.", f"sections are {', '.join(SECTIONS)}."
            )
        mapping = raw[section]
        for depth, key in enumerate(keys[:-1], start=1):
            if mapping.get(key) is None:
                mapping[key] = {}
            mapping = mapping[key]
            if not isinstance(mapping, dict):
                whole = ".".join([section, *keys[:depth]])
                raise DistsetupError(f"override '{item}': {whole} is not a mapping.", f"set it whole: {whole}=VALUE.")
        try:
            mapping[keys[-1]] = parse_yaml(value)
        except (yaml.YAMLError, ValueError):  # ValueError: a bad date, a 5000-digit integer, a bomb
            raise DistsetupError(
                f"override '{item}': the value is not valid YAML.",
                f"quote it: {dotted}='\"...\"' (a path or a string).",
            )
        if len(keys) == 1 and sets_something(section, keys[0], mapping[keys[0]]):
            _replace_the_files_other_spellings(raw, dotted, overridden)
        if section == "training" and len(keys) == 1 and mapping[keys[0]] is not None:
            _replace_the_files_other_length(mapping, keys[0], overridden)
    return raw


def _replace_the_files_other_spellings(raw: dict, dotted: str, overridden: set[str]) -> None:
    """An override of a setting replaces what the file writes of it under another name (`training.learning_rate=1e-3`
    over the file's `lr`), as over its own: the two would otherwise be one setting written twice."""
    for spelling in spellings(*dotted.split(".")) - {dotted} - overridden:
        section, key = spelling.split(".")
        if isinstance(raw.get(section), dict):
            raw[section].pop(key, None)


def _replace_the_files_other_length(training: dict, key: str, overridden: set[str]) -> None:
    for names, others in (RUN_LENGTH, RUN_LENGTH[::-1]):
        if key in names and not any(f"training.{other}" in overridden for other in others):
            for other in others:
                training.pop(other, None)


def config_problems(raw: dict, base_dir: Path | None = None) -> list[Problem]:
    return check_run_config(raw, base_dir).problems


def override_problems(overrides: Sequence[str]) -> list[Problem]:
    """The problems of the trainer's `section.key=value` overrides by themselves: a key that is no run config's, a
    value of another type or range. What spans keys or names files is left to where the run is (a job's pod: its
    image and volume)."""
    try:
        raw = apply_overrides({}, list(overrides))
    except DistsetupError as e:
        return [Problem("", e.problem, e.hint or "write section.key=value.")]
    return check_run_config(raw, cross_field=False).problems


def check_run_config(raw: dict, base_dir: Path | None = None, *, cross_field: bool = True) -> Checked:
    """Every problem in a raw run config: keys that are not names, other tools' names (read as distsetup's, in
    place), the schema (unknown keys, types, ranges, NaN and infinities), what the schema cannot say (whole numbers,
    blank names), then cross-field rules (unless `cross_field` is false); with the notes on how it was read."""
    problems = _key_problems(raw)
    if problems:
        return Checked(problems, [], {})
    wrong = wrong_kind_problem(raw, "run_config")
    if wrong:
        return Checked([wrong], [], {})
    notes, problems, spelled = _rewrite_into_own_keys(raw)
    written = {
        f"{section}.{key}": f"{section}.{key}"
        for section, values in raw.items()
        if isinstance(values, dict)
        for key in values
    } | spelled
    if problems:
        return Checked(problems, notes, written)
    problems = schema_problems(raw, "run_config", hint)
    reported = {p.path for p in problems}
    problems += [p for p in _value_problems(raw) if p.path not in reported]
    if not problems and cross_field:
        config = _build(raw)
        problems = cross_field_problems(config, base_dir) + step_count_problems(raw)
        found, said = _backend_file_findings(raw.get("distributed") or {}, config.distributed.backend)
        problems += found
        notes += said
        inline = (raw.get("distributed") or {}).get("fsdp")
        if inline:
            found, said = inline_findings(inline)
            problems += found
            notes += said
    return Checked(problems, notes, written)


def _rewrite_into_own_keys(raw: dict) -> tuple[list[str], list[Problem], dict[str, str]]:
    """`raw` rewritten in place into distsetup's own keys: older spellings of them, other tools' names, and FSDP
    settings written inline; (notes on what was read so, problems, {own key: the name it was written as})."""
    problems = _rewrite_older_forms(raw)
    notes, found, spelled = read_other_names(raw)
    problems += found
    distributed = raw.get("distributed")
    if isinstance(distributed, dict) and any(k.startswith("fsdp_") and k != "fsdp_config" for k in distributed):
        block, said, found = read_inline(distributed)
        notes += said
        problems += found
        if "fsdp" in distributed:
            problems.append(
                Problem(
                    "distributed.fsdp",
                    "FSDP settings are written both as distributed.fsdp and as fsdp_* keys beside it.",
                    "keep one of the two forms.",
                )
            )
        else:
            distributed["fsdp"] = block
    return notes, problems, spelled


def _rewrite_older_forms(raw: dict) -> list[Problem]:
    """`raw` rewritten in place from the forms users write distsetup's own keys in (other_names.OWN_KEY_FORMS:
    activation_checkpointing true is full, chunked_loss yes always, report_to "none" none); model.layer_cls named one
    class before model.layer_classes named several."""
    model = raw.get("model")
    for (section_name, key), form in OWN_KEY_FORMS.items():
        section = raw.get(section_name)
        if isinstance(section, dict) and key in section:
            section[key] = form(section[key])
    if isinstance(model, dict) and "layer_cls" in model:
        single = model.pop("layer_cls")
        if "layer_classes" in model and model["layer_classes"] != [single]:
            return [
                Problem(
                    "model.layer_cls",
                    f"layer_cls {single!r} and layer_classes {model['layer_classes']!r} name different classes.",
                    "keep layer_classes alone.",
                )
            ]
        model["layer_classes"] = [single] if single is not None else []
    return []


def _key_problems(data, path=()) -> list[Problem]:
    """Keys that YAML read as something other than a name: `1:`, `yes:` (true), `null:`, a date."""
    if isinstance(data, list):
        return [p for i, item in enumerate(data) for p in _key_problems(item, path + (i,))]
    if not isinstance(data, dict):
        return []
    problems = []
    for key, value in data.items():
        if isinstance(key, str):
            problems += _key_problems(value, path + (key,))
        else:
            problems.append(
                Problem(
                    join_path(path + (repr(key),)),
                    f"key {key!r} ({type(key).__name__}) is not a name.",
                    "write the key's name, e.g. micro_batch_size; quote it if YAML reads it "
                    "as a number, a boolean or a date.",
                )
            )
    return problems


def _value_problems(raw: dict) -> list[Problem]:
    """What JSON Schema cannot say: an integer field holds a Python int (the schema's "integer" takes 8.0,
    which the trainer cannot use as a batch size), and a text field that names something is not blank."""
    problems = []
    for section, cls in SECTIONS.items():
        values = raw.get(section)
        if not isinstance(values, dict):
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            value, kinds, where = values[f.name], _scalar_types(hints[f.name]), f"{section}.{f.name}"
            if int in kinds and isinstance(value, float):
                example = int(value) if value.is_integer() and abs(value) <= 2**53 else f.default
                problems.append(Problem(where, f"{value!r} is not a whole number.", f"write e.g. {example}."))
            if (
                str in kinds
                and "enum" not in f.metadata
                and any(
                    isinstance(item, str) and not item.strip()
                    for item in (value if isinstance(value, list) else [value])
                )
            ):
                problems.append(Problem(where, "is empty.", f"write a value, or remove {f.name} for the default."))
    return problems


def _scalar_types(hint) -> set:
    """int | None -> {int, NoneType}; list[str] -> {str}; int -> {int}."""
    return set(typing.get_args(hint)) or {hint}


def run_config_from(raw: dict, checked: Checked) -> RunConfig:
    """The RunConfig of a raw config that check_run_config found no problem in (and read into distsetup's keys)."""
    config = _build(raw)
    config.notes, config.written = checked.notes, checked.written
    return config


def model_config(section: dict) -> ModelConfig:
    """A model section as stored in a checkpoint's marker (older ones spell layer_cls) as a ModelConfig."""
    raw = {"model": dict(section)}
    _rewrite_older_forms(raw)
    return ModelConfig(**raw["model"])


def backend_chosen_by(kind: str, file: str | None) -> dict:
    """The `distributed` settings a launch flag for the backend `kind` makes (--use_deepspeed, --fsdp_config FILE):
    its backend is the run's, over the run config's keys, and its file, where it names one, the one read."""
    return {"backend": kind, "use_deepspeed": False, "use_fsdp": False, **({f"{kind}_config": file} if file else {})}


def backend_of(distributed: dict) -> str:
    """The backend a raw `distributed` section selects: an explicit backend, else the guides' keys, else the one
    backend whose file it names (a file alone trained DDP, unread, without a word)."""
    if "backend" in distributed:
        return distributed["backend"]
    if distributed.get("use_deepspeed") is True:
        return "deepspeed"
    if distributed.get("use_fsdp") is True:
        return "fsdp"
    choosing = _choosing_files(distributed)
    return choosing[0] if len(choosing) == 1 else DistributedConfig.backend


def _choosing_files(distributed: dict) -> list[str]:
    """The backends whose file the section names and whose `use_` key does not turn off (use_deepspeed: false
    beside a DeepSpeed file, as HF-style configs write it, trains DDP as it did)."""
    return [
        kind
        for kind in BACKEND_FILES
        if distributed.get(f"{kind}_config") and distributed.get(f"use_{kind}") is not False
    ]


def _backend_file_findings(distributed: dict, backend: str) -> tuple[list[Problem], list[str]]:
    """(problems, notes) of the backend files a `distributed` section names beside the backend it trains with: two
    files and nothing choosing between them is a problem, a file its backend does not read a note."""
    chosen = "backend" in distributed or any(distributed.get(key) is True for key in ("use_deepspeed", "use_fsdp"))
    if len(_choosing_files(distributed)) > 1 and not chosen:
        problem = Problem(
            "distributed",
            "deepspeed_config and fsdp_config are both given, and no backend says which one trains.",
            "set backend: deepspeed or backend: fsdp.",
            involves=("distributed.deepspeed_config", "distributed.fsdp_config"),
        )
        return [problem], []
    return [], [
        f"distributed.{kind}_config is read by backend {kind} only: this run trains {backend} without it."
        for kind in BACKEND_FILES
        if distributed.get(f"{kind}_config") and kind != backend
    ]


def _build(raw: dict) -> RunConfig:
    sections: dict = {name: cls(**raw.get(name, {})) for name, cls in SECTIONS.items()}  # type: ignore[operator]
    config = RunConfig(**sections)
    config.distributed.backend = backend_of(raw.get("distributed", {}))
    return config

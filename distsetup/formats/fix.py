"""`distsetup validate --fix`: a run config rewritten into distsetup's own keys, its comments and key order kept
(ruamel.yaml's round trip, not a dump). Other tools' names become distsetup's (formats/other_names.py), the guides'
inline fsdp_* keys become one `fsdp:` block in the FSDP file's spelling, settings no reader uses go. The text is
checked again before anyone writes it: a problem left, and nothing is written."""

import io
import json
import math
from typing import Any

from distsetup.errors import DistsetupError
from distsetup.formats.fsdp_inline import read_inline
from distsetup.formats.fsdp_rules import fsdp_findings
from distsetup.formats.other_names import AMBIGUOUS, OTHER_NAMES, OWN_KEY_FORMS
from distsetup.formats.reading import parse_yaml
from distsetup.formats.runconfig_load import check_run_config


def fixed_run_config(text: str, name: str) -> tuple[str, list[str]]:
    """The run config `text` in distsetup's own keys, and one line per change. Raises where a problem remains
    that renaming cannot fix."""
    from ruamel.yaml import YAML  # only here: every other command reads YAML with PyYAML

    yaml = YAML()  # round trip: comments, order and quoting stay
    yaml.preserve_quotes = True
    yaml.width = 4096
    document = yaml.load(text)
    changes: list[str] = []
    if isinstance(document, dict):
        _rename_other_names(document, changes)
        _warmup_ratio_in_steps(document, changes)
        _old_spellings(document, changes)
        _fold_inline_fsdp(document, changes)
    out = io.StringIO()
    yaml.dump(document, out)
    result = out.getvalue()
    checked = check_run_config(parse_yaml(result) or {})
    if checked.problems:
        raise DistsetupError(
            f"{name}: {checked.problems[0]} (--fix cannot fix this; nothing written)",
            f"fix it by hand (`distsetup validate {name}` lists every problem), then run --fix again.",
        )
    return result, changes


def _rename(section: Any, old: str, new: str, value) -> None:
    """section[old] becomes section[new] = value, at old's place, with old's comments."""
    position = list(section).index(old)
    comment = section.ca.items.pop(old, None)
    del section[old]
    section.insert(position, new, value)
    if comment is not None:
        section.ca.items[new] = comment


def _move(source: Any, key: str, target: Any, new: str, value) -> None:
    comment = source.ca.items.pop(key, None)
    del source[key]
    target[new] = value
    if comment is not None:
        target.ca.items[new] = comment


def _rename_other_names(document: Any, changes: list[str]) -> None:
    for (section_name, key), other in OTHER_NAMES.items():
        section = document.get(section_name)
        if not isinstance(section, dict) or key not in section or (section_name, key) in AMBIGUOUS:
            continue
        value = other.meaning(section[key])
        target_name, target_key = other.ours.split(".")
        if value is None:  # bf16: false says nothing
            del section[key]
            changes.append(f"removed {section_name}.{key} (false sets nothing)")
            continue
        if target_name not in document:
            document[target_name] = type(section)()
        target = document[target_name]
        if not isinstance(target, dict) or (target_key in target and target[target_key] != value):
            continue  # a problem the check afterwards names
        if target_key in target:
            del section[key]
            changes.append(f"removed {section_name}.{key} (the same as {other.ours})")
        elif target is section:
            _rename(section, key, target_key, value)
            changes.append(f"{section_name}.{key} -> {other.ours}")
        else:
            _move(section, key, target, target_key, value)
            changes.append(f"{section_name}.{key} -> {other.ours}")


def _warmup_ratio_in_steps(document: Any, changes: list[str]) -> None:
    """The HF Trainer's training.warmup_ratio in steps, where the run config gives training.max_steps (rounded up,
    as TrainingArguments.get_warmup_steps does); without max_steps (epochs) it stays a problem to fix by hand."""
    training = document.get("training")
    if not isinstance(training, dict) or "warmup_steps" in training:
        return
    ratio, steps = training.get("warmup_ratio"), training.get("max_steps")
    if not (isinstance(ratio, int | float) and isinstance(steps, int)) or isinstance(ratio, bool):
        return
    if not 0 <= ratio <= 1 or steps < 1:
        return
    _rename(training, "warmup_ratio", "warmup_steps", math.ceil(ratio * steps))
    changes.append(
        f"training.warmup_ratio {ratio} -> training.warmup_steps {training['warmup_steps']} ({ratio} x max_steps "
        f"{steps}, rounded up as the HF Trainer does)"
    )


def _old_spellings(document: Any, changes: list[str]) -> None:
    """distsetup's own keys in their other forms (other_names.OWN_KEY_FORMS: activation_checkpointing true -> full);
    layer_cls: X -> layer_classes: [X] (runconfig_load.py)."""
    model = document.get("model")
    for (section_name, key), form in OWN_KEY_FORMS.items():
        section = document.get(section_name)
        if isinstance(section, dict) and key in section and form(section[key]) != section[key]:
            written = _shown(section[key])
            section[key] = form(section[key])
            changes.append(f"{section_name}.{key} {written} -> {_shown(section[key])}")
    if isinstance(model, dict) and isinstance(model.get("layer_cls"), str) and "layer_classes" not in model:
        _rename(model, "layer_cls", "layer_classes", [model["layer_cls"]])
        changes.append("model.layer_cls -> model.layer_classes")


def _shown(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _fold_inline_fsdp(document: Any, changes: list[str]) -> None:
    """distributed's fsdp_* keys -> distributed.fsdp, in the FSDP file's spelling, without what no reader uses."""
    found = document.get("distributed")
    if not isinstance(found, dict) or "fsdp" in found:
        return
    distributed: Any = found  # a ruamel CommentedMap: comments in .ca, insert() at a position
    keys = [k for k in distributed if isinstance(k, str) and k.startswith("fsdp_") and k != "fsdp_config"]
    if not keys:
        return
    block, _, problems = read_inline({k: distributed[k] for k in keys})
    if problems:
        return  # the check afterwards names them
    _, unused = fsdp_findings(block, inline=True)
    for note in unused:
        key = note.split(" ", 1)[0]
        block.pop(key, None)
        changes.append(f"removed distributed.{key} ({note})")
    position = list(distributed).index(keys[0])
    folded: Any = type(distributed)(block)
    for key in keys:
        comment = distributed.ca.items.pop(key, None)
        if comment is not None and key in folded:
            folded.ca.items[key] = comment
        del distributed[key]
    distributed.insert(position, "fsdp", folded)
    changes.append(f"distributed's fsdp_* keys -> distributed.fsdp, in the FSDP file's spelling ({len(keys)} keys)")

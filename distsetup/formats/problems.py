"""A problem found in a config file (where it is, what is wrong, the fix), and the schema problems of one."""

import difflib
import json
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

from distsetup.errors import DistsetupError
from distsetup.formats.fast_schema import conforms


@dataclass(frozen=True)
class Problem:
    path: str  # "zero_optimization.offload_param.device"; "" for the whole file
    message: str
    fix: str
    # the other keys of a rule across keys (scale_lr for "scale_lr linear needs base_batch_size"): where the user
    # wrote one of them, there the problem is
    involves: tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return f"{self.path or '<file>'}: {self.message} Fix: {self.fix}"

    def as_error(self) -> DistsetupError:
        """The one line a command or the trainer stops with: where, what is wrong, and the fix."""
        return DistsetupError(f"{self.path}: {self.message}" if self.path else self.message, self.fix)


@dataclass(frozen=True)
class Violation:
    """A rule of a file format broken: the option to change, and what is wrong and the fix with {option} names and
    {value}s left to the words they are said in (flags, a file's keys, Accelerate's keys). A `said` one sets something
    no reader uses: flags refuse it (the user typed it just now), a file gets a note (its readers run without it)."""

    option: str
    message: str
    fix: str
    said: bool = False


def as_json(problems: list[Problem]) -> str:
    return json.dumps([{"path": p.path, "message": p.message, "fix": p.fix} for p in problems], indent=2)


def join_path(parts) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in parts).replace(".[", "[")


def closest(word: str, choices) -> str | None:
    """The choice `word` is most likely a typo of (in any case: fsdp -> FSDP), or None where none is close."""
    by_lower = {str(choice).lower(): choice for choice in sorted(choices, key=str)}
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def suggest(word: str, choices, what: str = "keys") -> str:
    """'did you mean X?' for a close match, else the list of valid choices (`what` they are: keys, values)."""
    close = closest(word, choices)
    if close is not None:
        return f"did you mean '{close}'?"
    return f"valid {what}: " + ", ".join(sorted(choices)) + "."


# What a format says of an unknown key beyond its own keys: hint(section, key, the section's own keys) -> the fix, or
# None for suggest's.
Hint = Callable[[str, str, Collection[str]], str | None]


@cache
def load_schema(name: str) -> dict:
    """A JSON Schema shipped in distsetup/formats/schemas/, e.g. 'deepspeed'."""
    return json.loads(resources.files("distsetup.formats.schemas").joinpath(f"{name}.schema.json").read_text())


def non_finite_problems(data, path=()) -> list[Problem]:
    """NaN and infinities anywhere: JSON has no such numbers (Python's json reads and writes NaN, Infinity;
    YAML has .nan and .inf), no schema range excludes NaN, and a NaN learning rate trains nothing."""
    if isinstance(data, float) and not math.isfinite(data):
        return [Problem(join_path(path), f"{data} is not a finite number.", "write a finite number.")]
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    return [p for key, value in children for p in non_finite_problems(value, path + (key,))]


def schema_problems(data, schema_name: str, hint: Hint | None = None) -> list[Problem]:
    """Every place `data` breaks the named schema or holds a non-finite number; unknown keys come with
    `hint(section, key, known)` where it has one (another tool's name, or a typo of one), else a close-match
    suggestion."""
    return schema_problems_in(data, load_schema(schema_name), hint)


def schema_problems_in(data, schema: dict, hint: Hint | None = None) -> list[Problem]:
    """schema_problems, for a schema given as data."""
    problems = non_finite_problems(data)
    if conforms(data, schema):
        return problems
    import jsonschema  # only when there is something to explain (a quarter of a command's time)

    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        if isinstance(error.instance, float) and not math.isfinite(error.instance):
            continue  # said above
        error = _in_the_branch_of_its_type(error)
        path = list(error.absolute_path)
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            for key in sorted(set(error.instance) - set(known)):
                said = hint(join_path(path), str(key), known) if hint else None
                problems.append(Problem(join_path(path + [key]), f"unknown key '{key}'.", said or suggest(key, known)))
        else:
            problems.append(Problem(join_path(path), *_describe(error)))
    return problems


def _in_the_branch_of_its_type(error):
    """An anyOf's own message ("... is not valid under any of the given schemas") says nothing of what is wrong;
    where a branch takes the value's type (a SkyPilot mount written as an object, not a string), its error does."""
    if error.validator not in ("anyOf", "oneOf") or not error.context:
        return error
    of_its_type = [e for e in error.context if not (e.validator == "type" and not e.relative_path)]
    if not of_its_type:
        return error
    from jsonschema.exceptions import best_match

    return _in_the_branch_of_its_type(best_match(of_its_type))


def _describe(error) -> tuple[str, str]:
    """(what is wrong, the fix) for one schema violation."""
    value, limit = error.instance, error.validator_value
    if error.validator == "enum":
        if isinstance(value, str) and value in [str(c) for c in limit if not isinstance(c, str | bool)]:
            return f"{value!r} is a string, not the number it spells.", f"write {value} without quotes."
        return f"{value!r} is not allowed.", f"use one of {', '.join(map(repr, limit))}."
    if error.validator in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        bound = {"minimum": "at least", "exclusiveMinimum": "above", "maximum": "at most", "exclusiveMaximum": "below"}[
            error.validator
        ]
        return f"{value!r} is out of range.", f"use a value {bound} {limit}."
    if error.validator == "type":
        expected = " or ".join(limit) if isinstance(limit, list) else limit
        if isinstance(value, str) and {"number", "integer"} & set(limit if isinstance(limit, list) else [limit]):
            number = _as(value, float if "number" in limit else int)
            if number is not None and math.isfinite(number):  # written as JSON and PyYAML both read a number
                written = _written(number)
                unquoted = (
                    "without quotes" if written == value.strip() else "unquoted, as YAML and JSON both read a number"
                )
                return f"{value!r} is a string, not the number it spells.", f"write {written} {unquoted}."
        return f"{value!r} has the wrong type.", f"write a{'n' if expected[0] in 'aeiou' else ''} {expected}."
    if error.validator in ("minItems", "maxItems"):
        bound = "at least" if error.validator == "minItems" else "at most"
        wanted = error.schema.get("description") or f"{bound} {limit} item(s)"
        return f"{value!r} has {len(value)} item(s), {bound} {limit} wanted.", f"write {wanted}."
    if error.validator == "required":
        return error.message + ".", "add it."
    if error.validator in ("pattern", "maxLength") and "description" in error.schema:  # a form (jobs/forms.py)
        examples = error.schema.get("examples", [])
        return f"{value!r} is not {error.schema['description']}.", (f"e.g. {examples[0]}." if examples else "fix it.")
    return error.message + ".", "see the schema in distsetup/formats/schemas/."


def wrong_type(path: str, value, wanted: type, reader: str) -> Problem | None:
    """`value` where `reader` (a program that does not convert what it reads) takes a `wanted` (int, float or
    bool), or None when it is one. The fix writes the value so that YAML and JSON read it as that type."""
    if wanted is bool:
        if isinstance(value, bool):
            return None
    elif not isinstance(value, bool) and isinstance(value, int if wanted is int else (int, float)):
        return None
    kind = {int: "a whole number", float: "a number", bool: "true or false"}[wanted]
    what = "a string" if isinstance(value, str) else "null" if value is None else f"a {type(value).__name__}"
    converted = _as(value, wanted) if isinstance(value, str) else None
    key = path.rsplit(".", 1)[-1]
    if converted is None:
        fix = f"write {kind} there."
    elif _written(converted) != value.strip():  # 3e-05: YAML 1.1 (PyYAML) reads it as text, quoted or not
        fix = f"write {key}: {_written(converted)} (PyYAML reads {value.strip()} as text)."
    else:
        fix = f"write {key}: {_written(converted)} without quotes."
    return Problem(path, f"{value!r} is {what}; {reader} takes {kind} here and does not convert it.", fix)


def _as(text: str, wanted: type):
    """What a string means as the wanted type, or None."""
    text = text.strip()
    if wanted is bool:
        return {"true": True, "false": False}.get(text.lower())
    try:
        return int(text) if wanted is int else float(text)
    except ValueError:
        return None


def _written(value) -> str:
    """A value as YAML 1.1 (PyYAML) and JSON both read it back: true, 8, 3.0e-05 (PyYAML reads 3e-05 as text)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text

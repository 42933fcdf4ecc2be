"""Config files: reading one within limits, and a problem found in it (where it is, what is wrong, the fix)."""

import difflib
import json
import math
import os
import stat
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.fast_schema import conforms

# A DeepSpeed file or a run config is a few kB with some dozens of values a few levels deep. Anything far
# beyond that is not a config (a FIFO, /dev/zero, a nesting or YAML-alias bomb): refused before it can hang
# a command or eat its memory.
MAX_CONFIG_BYTES = 2**20
MAX_DEPTH = 64
MAX_VALUES = 10_000
_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
_NOT_A_CONFIG = "give the config file itself."


class TooComplex(ValueError):
    """Parsed config data nested deeper or holding more values than any config does."""


def read_config_text(path: Path, what: str) -> str:
    """The text of a config file: a regular file of at most MAX_CONFIG_BYTES of UTF-8, else one clear error.

    Opened without blocking and checked on the open file (no stat-then-open race): a FIFO, a device or a
    directory is refused before a single byte is read, and at most the limit is read from anything.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise DistsetupError(f"cannot read {what} {path}: {e.strerror}.", "check the path.")
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise DistsetupError(
            f"{what} {path} is {_FILE_KINDS.get(kind, 'not a regular file')}, not a file.", _NOT_A_CONFIG
        )
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise DistsetupError(f"cannot read {what} {path}: {e.strerror}.", "check the path.")
    if len(data) > MAX_CONFIG_BYTES:
        raise DistsetupError(
            f"{what} {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, the most a config file may hold.",
            _NOT_A_CONFIG,
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise DistsetupError(f"{what} {path} is not UTF-8 text.", _NOT_A_CONFIG)


TOO_DEEP = f"nests deeper than {MAX_DEPTH} levels"


def check_size(values: int, depth: int) -> None:
    """Raise TooComplex for data of more than MAX_VALUES values or MAX_DEPTH levels."""
    if depth > MAX_DEPTH:
        raise TooComplex(TOO_DEEP)
    if values > MAX_VALUES:
        raise TooComplex(f"holds more than {MAX_VALUES:,} values")


def check_shape(data) -> None:
    """check_size for parsed data (a tree of dicts and lists), walked without recursion."""
    values, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        values += 1
        check_size(values, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)


def too_complex(path: Path, what: str, error: TooComplex) -> DistsetupError:
    return DistsetupError(
        f"{what} {path} {error}.",
        "a config file holds some dozens of settings a few levels deep; give the config file itself.",
    )


@dataclass(frozen=True)
class Problem:
    path: str  # "zero_optimization.offload_param.device"; "" for the whole file
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path or '<file>'}: {self.message} Fix: {self.fix}"


def as_json(problems: list[Problem]) -> str:
    return json.dumps([asdict(p) for p in problems], indent=2)


def join_path(parts) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in parts).replace(".[", "[")


def suggest(word: str, choices) -> str:
    """'did you mean X?' for a close match, else the list of valid choices."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return "valid keys: " + ", ".join(sorted(choices)) + "."


@cache
def load_schema(name: str) -> dict:
    """A JSON Schema shipped in distsetup/schemas/, e.g. 'deepspeed'."""
    return json.loads(resources.files("distsetup.schemas").joinpath(f"{name}.schema.json").read_text())


def non_finite_problems(data, path=()) -> list[Problem]:
    """NaN and infinities anywhere: JSON has no such numbers (Python's json reads and writes NaN, Infinity;
    YAML has .nan and .inf), no schema range excludes NaN, and a NaN learning rate trains nothing."""
    if isinstance(data, float) and not math.isfinite(data):
        return [Problem(join_path(path), f"{data} is not a finite number.", "write a finite number.")]
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    return [p for key, value in children for p in non_finite_problems(value, path + (key,))]


def schema_problems(data, schema_name: str) -> list[Problem]:
    """Every place `data` breaks the named schema or holds a non-finite number; unknown keys come with a
    close-match suggestion."""
    problems = non_finite_problems(data)
    schema = load_schema(schema_name)
    if conforms(data, schema):
        return problems
    import jsonschema  # only when there is something to explain (a quarter of a command's time)

    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        if isinstance(error.instance, float) and not math.isfinite(error.instance):
            continue  # said above
        path = list(error.absolute_path)
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            for key in sorted(set(error.instance) - set(known)):
                problems.append(Problem(join_path(path + [key]), f"unknown key '{key}'.", f"{suggest(key, known)}"))
        else:
            problems.append(Problem(join_path(path), *_describe(error)))
    return problems


def _describe(error) -> tuple[str, str]:
    """(what is wrong, the fix) for one schema violation."""
    value, limit = error.instance, error.validator_value
    if error.validator == "enum":
        return f"{value!r} is not allowed.", f"use one of {', '.join(map(repr, limit))}."
    if error.validator in ("minimum", "exclusiveMinimum", "maximum"):
        bound = {"minimum": "at least", "exclusiveMinimum": "above", "maximum": "at most"}[error.validator]
        return f"{value!r} is out of range.", f"use a value {bound} {limit}."
    if error.validator == "type":
        expected = " or ".join(limit) if isinstance(limit, list) else limit
        return f"{value!r} has the wrong type.", f"write a{'n' if expected[0] in 'aeiou' else ''} {expected}."
    if error.validator == "required":
        return error.message + ".", "add it."
    return error.message + ".", "see the schema in distsetup/schemas/."

"""Reading a config file within limits: a regular file of UTF-8 text, at most MAX_CONFIG_BYTES, parsed into
at most MAX_VALUES values MAX_DEPTH levels deep. JSON keys given twice are remembered (validate reports them);
YAML reads numbers as users write them. Every failure is one DistsetupError naming the file."""

import json
import os
import re
import stat
from pathlib import Path

import yaml

from distsetup.errors import DistsetupError
from distsetup.formats.problems import Problem, join_path

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


# What a key written twice does: json.load keeps the last one, and DeepSpeed, reading a file itself, refuses it
LAST_ONE_COUNTS = "only the last one counts"
DEEPSPEED_REFUSES_IT = (
    'DeepSpeed refuses the file where it reads it itself ("Duplicate keys in DeepSpeed config"), and the HF Trainer '
    "and Accelerate, which read it with json.load, keep the last one"
)


def duplicate_key_problems(data, path=(), what_it_does: str = LAST_ONE_COUNTS) -> list[Problem]:
    problems = []
    if isinstance(data, _KeysSeenTwice):
        problems += [
            Problem(join_path(path + (k,)), f"key '{k}' appears more than once: {what_it_does}.", "keep one of them.")
            for k in data.duplicates
        ]
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in children:
        problems += duplicate_key_problems(value, path + (key,), what_it_does)
    return problems


def read_json(path: Path) -> dict:
    """A JSON config file as a dict, read within the limits of read_config_text and check_shape.
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


class _PyYamlLoader(yaml.SafeLoader):
    """YAML as PyYAML's safe_load reads it (Accelerate and HfArgumentParser do: `3e-4` is a string there).

    Composed within check_size, an alias counting as every value it stands for: a nesting bomb or
    an alias bomb ("billion laughs": a few lines that expand to 10^9 values) is refused after at most
    MAX_VALUES nodes, before anything walks the expanded data; an anchor used inside itself is refused too.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) with aliases expanded

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            target = self.anchors.get(self.peek_event().anchor)
            if target is not None and id(target) not in self._sizes:
                raise TooComplex("uses an anchor inside itself (a recursive alias)")
            return super().compose_node(parent, index)  # a node composed and measured before
        self._depth += 1
        check_size(0, self._depth)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        children = (
            node.value
            if isinstance(node, yaml.SequenceNode)
            else [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else []
        )
        sizes = [self._sizes[id(child)] for child in children]
        self._sizes[id(node)] = (1 + sum(v for v, _ in sizes), 1 + max((d for _, d in sizes), default=0))
        check_size(*self._sizes[id(node)])
        if isinstance(node, yaml.MappingNode):
            self._check_unique_keys(node)
        return node

    @staticmethod
    def _check_unique_keys(node: yaml.MappingNode) -> None:
        """A key written twice in one mapping is refused: PyYAML keeps the last one, so a second `training:` section
        appended to a file dropped every setting of the first without a word (YAML itself has keys unique, and
        kubectl's strict decoding refuses them). Checked as composed, before merge keys (`<<`) copy pairs in."""
        first_seen: dict = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            if key in first_seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"key '{key_node.value}' is written a second time (first at line {first_seen[key] + 1}), "
                    "and only the last would count: merge the two",
                    problem_mark=key_node.start_mark,
                )
            first_seen[key] = key_node.start_mark.line


class _Loader(_PyYamlLoader):
    """YAML as users write it: `3e-4` is a float (PyYAML's YAML 1.1 rules read it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def parse_yaml(text: str, as_pyyaml: bool = False):
    return yaml.load(text, Loader=_PyYamlLoader if as_pyyaml else _Loader)


def yaml_problem(error: yaml.YAMLError) -> str:
    """Where and what PyYAML found, in one line: 'line 3, column 1: found character '\\t' that cannot start any
    token' (its first line alone, 'while scanning for the next token', says neither)."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem is None or mark is None:
        return str(error).splitlines()[0]
    tab = " (a tab: YAML indents with spaces)" if "'\\t'" in problem else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{tab}"


def read_yaml(path: Path, as_pyyaml: bool = False) -> dict:
    """A config file as a dict, read within the limits of read_config_text and _Loader; `as_pyyaml`: as
    yaml.safe_load reads it, for files other programs read that way (Accelerate's, TrainingArguments)."""
    return yaml_mapping(read_config_text(path, "run config"), path, as_pyyaml)


def yaml_mapping(text: str, path: Path, as_pyyaml: bool = False) -> dict:
    """The text of config file `path` as a dict (read_yaml's), or one DistsetupError naming the file."""
    try:
        raw = parse_yaml(text, as_pyyaml) or {}
    except TooComplex as e:
        raise too_complex(path, "run config", e)
    except yaml.YAMLError as e:
        raise DistsetupError(f"{path} is not valid YAML: {yaml_problem(e)}.", "fix the YAML syntax.")
    except ValueError as e:  # a date such as 2024-13-45, an integer of more digits than Python converts
        raise DistsetupError(
            f"{path} is not valid YAML: {str(e).split(';')[0]}.", "fix the value, or quote it to make it a string."
        )
    if not isinstance(raw, dict):
        raise DistsetupError(f"{path} must hold a mapping of sections.", "start with e.g. 'training:'.")
    return raw


def read_yaml_documents(path: Path) -> list:
    """The documents of a multi-document YAML file (Kubernetes manifests), within the same limits, each read as
    Kubernetes reads YAML (1.1, as PyYAML: `3e-4` is a string); empty documents left out."""
    text = read_config_text(path, "manifest")
    try:
        return [doc for doc in yaml.load_all(text, Loader=_PyYamlLoader) if doc is not None]
    except TooComplex as e:
        raise too_complex(path, "manifest", e)
    except yaml.YAMLError as e:
        raise DistsetupError(f"{path} is not valid YAML: {yaml_problem(e)}.", "fix the YAML syntax.")
    except ValueError as e:
        raise DistsetupError(f"{path} is not valid YAML: {str(e).split(';')[0]}.", "quote the value.")

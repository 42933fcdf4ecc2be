"""The user's own functions a run config names as module:function (model.builder, data.builder, data.collate,
training.loss): imported from the run config's folder or PYTHONPATH, and called with one clear line naming the
key when they cannot be."""

import importlib
import inspect
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from distsetup.errors import DistsetupError, first_line
from distsetup.formats import python_refs
from distsetup.formats.runconfig import RunConfig


def raised_in_user_code(error: BaseException) -> str:
    """' (at buggy.py:3, in helper)': where `error` was raised in the user's own code (the innermost frame of its
    traceback outside installed packages, the standard library and distsetup), or '' where none of it is."""
    return innermost_users_frame((f.filename, f.lineno, f.name) for f in traceback.extract_tb(error.__traceback__))


def innermost_users_frame(frames: Iterable[tuple[str, int | str | None, str]]) -> str:
    """' (at buggy.py:3, in helper)': the innermost of `frames` (file, line, function; outermost first) in the
    user's own code, or '' where none is."""
    users = [frame for frame in frames if users_file(frame[0])]
    if not users:
        return ""
    filename, line, name = users[-1]
    path = Path(filename)
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    return f" (at {shown}:{line}, in {name})"


def what_raised(error: BaseException) -> str:
    """'ZeroDivisionError: division by zero (at buggy.py:3, in helper)': the error, in one line, and where in the
    user's own code it was raised."""
    return f"{type(error).__name__}: {first_line(error)}{raised_in_user_code(error)}"


def users_file(filename: str) -> bool:
    paths = sysconfig.get_paths()
    libraries = [Path(paths[key]) for key in ("purelib", "platlib", "stdlib", "platstdlib")]
    libraries += [Path(folder) for folder in (*site.getsitepackages(), site.getusersitepackages())]
    path = Path(filename)
    return not (
        filename.startswith("<")  # <frozen ...>, <string>
        or {"site-packages", "dist-packages"} & set(path.parts)
        or any(path.is_relative_to(folder) for folder in (*libraries, Path(__file__).parents[1]))
    )


def make_importable(base_dir: Path | None) -> Path:
    """Put the run config's folder first on the import path, as `python script.py` does with the script's folder
    (the user's modules may import their neighbours later, and DataLoader workers unpickle by name), and the working
    folder after it, as `python -m` does (so `python src/train.py` finds what `python -m distsetup.train` finds:
    python_refs.search_path); returns the run config's folder."""
    folder = (base_dir or Path.cwd()).resolve()
    for position, path in enumerate((str(folder), str(Path.cwd().resolve()))):
        if path not in sys.path:
            sys.path.insert(position, path)
    return folder


def found_in(reference: str) -> Path | None:
    """The folder on the import path that the module of `reference` ("module:function", imported already) was found
    in, which another process puts on its path to import it again (`distsetup checkpoint convert`, run from another
    folder); None where it has no file (a namespace package spread over several)."""
    parts = python_refs.split(reference)
    top = sys.modules.get(parts[0].split(".")[0]) if parts else None
    if top is None:
        return None
    if hasattr(top, "__path__"):  # a package: the folder that holds it
        folders = list(top.__path__)
        return Path(folders[0]).parent if len(folders) == 1 else None
    file = getattr(top, "__file__", None)
    return Path(file).parent if file else None


def load(reference: str, where: str) -> Callable:
    """The function `reference` ("module:function") names, at run-config key `where`."""
    parts = python_refs.split(reference)
    if parts is None:
        raise DistsetupError(f"{where} {reference!r} is not written module:function.", "e.g. scorer:build_model.")
    module_name, attribute = parts
    try:
        found = importlib.import_module(module_name)
    except ImportError as e:
        raise DistsetupError(
            f"{where}: cannot import {module_name} ({type(e).__name__}: {e}).",
            "put it next to the run config or on PYTHONPATH, and install what it imports.",
        ) from None
    except Exception as e:  # the module itself raised while being imported
        raise DistsetupError(
            f"{where}: importing {module_name} raised {type(e).__name__}: {first_line(e)}.", f"fix {module_name}."
        ) from None
    for name in attribute.split("."):
        if not hasattr(found, name):
            raise DistsetupError(
                f"{where}: {module_name} has no {attribute}.", f"define {attribute} in {module_name}, or fix {where}."
            )
        found = getattr(found, name)
    if not callable(found):
        raise DistsetupError(
            f"{where}: {reference} is a {type(found).__name__}, not a function.", f"name a function in {where}."
        )
    if where in CALLED_WITH:
        _check_called_with(found, where, reference)
    return found


# The functions distsetup calls on the run's values, with what, and what they return
CALLED_WITH = {"training.loss": (("model", "batch"), "the loss"), "data.collate": (("samples",), "the batch")}


def _check_called_with(function: Callable, where: str, reference: str) -> None:
    parameters, returns = CALLED_WITH[where]
    call = f"{where}({', '.join(parameters)})"
    fix = f"name a function that takes ({', '.join(parameters)}) and returns {returns}."
    # a class would be constructed: no loss is an instance of one (a batch may be: a dict subclass)
    if where == "training.loss" and inspect.isclass(function):
        raise DistsetupError(f"{where}: {reference} is a class, which {call} would construct.", fix)
    try:  # as it is called: a decorator's own parameters, not those of the function it wraps
        signature = inspect.signature(function, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or C function: its call will say
        return
    try:
        signature.bind(*parameters)
    except TypeError as e:
        raise DistsetupError(f"{where}: {reference} cannot be called as {call}: {e}.", fix) from None


def check_takes(function: Callable, where: str, *args, **kwargs) -> None:
    """Refuse, before calling it, a function that cannot be called with these arguments (a missing or an unknown
    keyword from the run config's args)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C function: its call will say
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        section = where.split(".")[0]
        raise DistsetupError(
            f"{where} {function.__qualname__}{signature} cannot be called with {_described(args, kwargs)}: {e}.",
            f"make {section}.args match its parameters.",
        ) from None


def _described(args: tuple, kwargs: dict) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"({', '.join(shown)})"


def check_references(cfg: RunConfig, base_dir: Path | None) -> None:
    """What `--check` finds of the user's own code before any process starts, without running it: each function
    the run config names imports, and the builders take the run config's arguments (a launch script then stops in one
    line, before torchrun adds its traceback of the ranks that failed). A module that raises something else while it
    is imported here is left to the ranks: it may need what the launcher sets (LOCAL_RANK)."""
    make_importable(base_dir)
    m, d, t = cfg.model, cfg.data, cfg.training
    checks: list[tuple[str, str | None, tuple, dict]] = [
        ("model.builder", m.builder if m.type == "python" else None, (), m.args),
        ("data.builder", d.builder if d.type == "python" else None, ("train",), d.args),
        ("data.collate", d.collate, (), {}),
        ("training.loss", t.loss, (), {}),
    ]
    for where, reference, args, kwargs in checks:
        if reference is None or not imports_here(reference):
            continue
        function = load(reference, where)
        if where.endswith("builder"):
            check_takes(function, where, *args, **kwargs)


def imports_here(reference: str) -> bool:
    """Whether the module of `reference` imports in this process, or fails as it would anywhere (it is missing, or
    its syntax is wrong: load() then says so)."""
    parts = python_refs.split(reference)
    if parts is None:
        return True
    try:
        importlib.import_module(parts[0])
    except (ImportError, SyntaxError):
        return True
    except Exception:
        return False
    return True

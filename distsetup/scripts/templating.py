"""The one Jinja environment for shell scripts: strict, shell-quoting, templates from templates/."""

import contextlib
import importlib.util
import shlex
from pathlib import Path

import jinja2

from distsetup import __version__
from distsetup.errors import DistsetupError


def templates_dir() -> Path:
    """templates/ of an installed wheel or editable install, else of the source checkout."""
    spec = importlib.util.find_spec("distsetup.templates")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[2] / "templates"


class CompiledTemplateCache(jinja2.FileSystemBytecodeCache):
    """Templates compiled by earlier runs (a fifth of a launcher command's time), in Jinja's private per-user
    temp folder, keyed by the template's source and distsetup's version (which fixes the environment's
    settings); a cache that cannot be used is skipped, never an error."""

    def __init__(self, directory: str | None = None):
        super().__init__(directory, pattern=f"__distsetup_{__version__}_%s.cache")

    def load_bytecode(self, bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # unreadable or damaged (Jinja unpickles the checksum unguarded): compile afresh
            bucket.reset()

    def dump_bytecode(self, bucket) -> None:
        with contextlib.suppress(OSError):
            super().dump_bytecode(bucket)


def compiled_template_cache() -> CompiledTemplateCache | None:
    try:
        return CompiledTemplateCache()
    except (OSError, RuntimeError):  # no safe, writable temp folder: compile every time
        return None


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        bytecode_cache=compiled_template_cache(),
    )
    env.filters["shquote"] = lambda value: shlex.quote(str(value))
    return env


def render(template_name: str, **context) -> str:
    """Render a template, turning a template mistake into one line naming the template and variable."""
    try:
        return environment().get_template(template_name).render(**context)
    except jinja2.UndefinedError as e:
        raise DistsetupError(f"template {template_name}: {e.message}.", "this is a distsetup bug; please report it.")
    except jinja2.TemplateSyntaxError as e:
        raise DistsetupError(
            f"template {e.name} line {e.lineno}: {e.message}.", "this is a distsetup bug; please report it."
        )

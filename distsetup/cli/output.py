"""Writing generated files: atomically, or to stdout, or not at all (dry run), and never over an input."""

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import click

from distsetup.errors import DistsetupError
from distsetup.formats.file_kinds import KIND_WORDS, content_kind
from distsetup.formats.problems import Problem
from distsetup.formats.reading import read_yaml
from distsetup.scripts.shell_words import check_text


def json_text(data: dict) -> str:
    """A config as JSON text: strict JSON (no NaN or Infinity, which Python's json would write)."""
    try:
        return json.dumps(data, indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise DistsetupError(
            "a value of the config is not a finite number (NaN or infinity).",
            "give finite numbers; a computed value that overflows means the inputs are too large.",
        )


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file: the same resolved path, or (both existing) the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def writable_target(path: Path, inputs: Mapping[str, str | Path | None], option: str = "--output") -> Path:
    """The file that writing `path` replaces: `path`, or the file its symbolic link points at (the link stays).

    Refused, each in one line: a link to nothing or a loop of links (replacing it would silently turn the
    link into a file), something that is not a regular file (a folder, /dev/null, a FIFO), and any of the
    command's `inputs` ({what: path}), also when reached through a link or a hard link.
    """
    shown = str(path)
    check_text(option, shown)  # the files' headers and the Next: line name it on one line
    if path.is_symlink():
        try:
            path.stat()
        except FileNotFoundError:
            raise DistsetupError(
                f"{option} {path} is a symbolic link to {os.readlink(path)}, which does not exist.",
                f"point the link at a file, remove it, or choose another {option}.",
            )
        except OSError as e:
            raise DistsetupError(
                f"{option} {path} is a symbolic link that cannot be followed ({e.strerror}).",
                f"fix or remove the link, or choose another {option}.",
            )
        path = Path(os.path.realpath(path))
        shown = f"{shown} (a link to {path})"
    if path.exists() and not path.is_file():
        raise DistsetupError(f"{option} {shown} exists and is not a regular file.", f"choose a file name for {option}.")
    for what, source in inputs.items():
        if source and _same_file(path, Path(source)):
            raise DistsetupError(
                f"{option} {shown} is this command's {what} ({source}): writing there would destroy it.",
                f"choose another {option}.",
            )
    return path


def check_replaced_kind(path: Path, kind: str, option: str = "--output") -> None:
    """A config of `kind` written over an existing file replaces only a config of that kind (or one its keys do not
    tell, or a .json file it cannot read): a DeepSpeed file written with -o config.yaml replaced the run config, one
    written with -o train.py the training script."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        data = read_yaml(path)  # JSON is YAML
    except DistsetupError:
        if path.suffix == ".json":  # a JSON config's place, whatever it holds now
            return
        held = "something that is no config"
    else:
        found = content_kind(data)
        if found is None or found == kind:
            return
        held = KIND_WORDS[found]
    raise DistsetupError(
        f"{option} {path} holds {held}: writing {KIND_WORDS[kind]} there would destroy it.",
        f"choose another {option} (this command writes JSON).",
    )


def write_atomic(
    path: Path,
    text: str,
    executable: bool = False,
    inputs: Mapping[str, str | Path | None] | None = None,
    option: str = "--output",
) -> None:
    """Replace `path` with `text` whole, or leave it untouched if anything fails (see writable_target)."""
    path = writable_target(Path(path), inputs or {}, option)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise DistsetupError(
            f"cannot write {path}: {e.strerror} ({e.filename}).", f"choose an {option} in a folder you can write to."
        )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # whatever the locale: what YAML and JSON readers expect
            f.write(text)
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def emit(
    text: str,
    output: str | None,
    dry_run: bool,
    next_step: str | None = None,
    executable: bool = False,
    inputs: Mapping[str, str | Path | None] | None = None,
    remarks: Sequence[str] = (),
    kind: str | None = None,
) -> None:
    """Print `text` (no output, '-' or a dry run) or write it to `output` (never over one of the command's
    `inputs`, {what: path}, nor over a config of another kind than `kind`, where the text is a config) and say what
    comes next. `remarks` ("Note: ...", "Warning: ...") go to stderr once nothing stands in the way, so they never
    precede an error."""
    if output not in (None, "-") and not dry_run:
        target = writable_target(Path(output), inputs or {})
        if kind is not None:
            check_replaced_kind(target, kind)
        write_atomic(Path(output), text, executable=executable, inputs=inputs)
    for remark in remarks:
        click.echo(remark, err=True)
    if output in (None, "-"):
        click.echo(text, nl=False)
        return
    if dry_run:
        click.echo(text, nl=False)
        click.echo(f"# dry run: would write {output}", err=True)
        return
    click.echo(f"Wrote {output}", err=True)
    if next_step:
        click.echo(f"Next: {next_step}", err=True)


def refuse_generated_problems(problems: list[Problem]) -> None:
    """A file a command built must pass `validate` as it stands; if not, that is distsetup's bug, said so."""
    if problems:
        raise DistsetupError(
            f"the generated config fails its own check: {problems[0]}",
            "this is a distsetup bug; please report the command line.",
        )

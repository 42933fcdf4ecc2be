"""Writing generated files: atomically, or to stdout, or not at all (dry run)."""

import os
import tempfile
from pathlib import Path

import click

from distsetup.errors import DistsetupError


def write_atomic(path: Path, text: str, executable: bool = False) -> None:
    """Replace `path` with `text` whole, or leave it untouched if anything fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise DistsetupError(f"cannot write {path}: {e.strerror} ({e.filename}).",
                             "choose an --output in a folder you can write to.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def emit(text: str, output: str | None, dry_run: bool, next_step: str | None = None,
         executable: bool = False) -> None:
    """Print `text` (no output, '-' or a dry run) or write it to `output` and say what comes next."""
    if output in (None, "-"):
        click.echo(text, nl=False)
        return
    if dry_run:
        click.echo(text, nl=False)
        click.echo(f"# dry run: would write {output}", err=True)
        return
    write_atomic(Path(output), text, executable=executable)
    click.echo(f"Wrote {output}", err=True)
    if next_step:
        click.echo(f"Next: {next_step}", err=True)

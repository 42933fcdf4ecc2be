"""A checkpoint folder as files, readable without torch: `output_dir/checkpoints/step_NNNNNNN/`, which counts
only once its `COMPLETE` marker exists. Rank 0 writes the marker (atomically, with the run's metadata and the size
of every file in the folder) after every rank's part is on disk; a folder whose marker is missing, not ours, or
whose files no longer have the sizes it lists is passed over for the one before it. `distsetup checkpoint ls`
and the trainer read folders through this module."""

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

MARKER = "COMPLETE"
STEP_FOLDER = re.compile(r"step_(\d+)")
REQUIRED_META = ("backend", "step", "world_size")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def latest_complete(root: Path) -> Path | None:
    """The newest checkpoint folder that is complete and intact (DeepSpeed's `latest` is never read)."""
    return find_resume(root)[0]


def find_resume(root: Path) -> tuple[Path | None, list[str]]:
    """(the newest intact checkpoint, what was wrong with each newer folder that has a COMPLETE marker)."""
    damaged: list[str] = []
    for step, path in reversed(_marked(root)):
        problem = damage(path, step)
        if problem is None:
            return path, damaged
        damaged.append(f"{path}: {problem}")
    return None, damaged


def beyond_newest(root: Path, keep: int) -> list[Path]:
    """The complete, intact checkpoint folders under `root` older than its `keep` newest ones (keep >= 1): what
    training.keep_checkpoints removes. Folders without a marker (being written, or a crash's leftovers) and
    damaged ones are never among them."""
    intact = [path for step, path in _marked(root) if damage(path, step) is None]
    return intact[: max(len(intact) - keep, 0)]


def _marked(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step_* folder under `root` with a COMPLETE marker, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        (int(m.group(1)), d)
        for d in root.glob("step_*")
        if (m := STEP_FOLDER.fullmatch(d.name)) and (d / MARKER).is_file()
    )


def damage(path: Path, step: int) -> str | None:
    """What makes checkpoint folder `path` (step_`step`) unusable, or None: its marker must be ours and name `step`,
    and every file the marker lists must be there with the size it had when the checkpoint completed."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError):
        return f"{MARKER} is not a distsetup marker (unreadable or not JSON)"
    if not isinstance(meta, dict) or any(key not in meta for key in REQUIRED_META):
        return f"{MARKER} lacks {', '.join(REQUIRED_META)}"
    if meta["step"] != step:
        return f"{MARKER} names step {meta['step']}"
    files = meta.get("files") or {}
    if not isinstance(files, dict):
        return f"{MARKER}'s files are not a mapping of names to sizes"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, not the {size} it was written with"
    return None


def read_meta(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


def file_sizes(path: Path) -> dict[str, int]:
    """Every file under checkpoint folder `path` (its marker aside) and its size in bytes."""
    return {
        str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file() and f.name != MARKER
    }


@dataclass(frozen=True)
class Listed:
    """One step_* folder as `distsetup checkpoint ls` shows it."""

    path: str
    step: int
    backend: str | None
    zero_stage: int | None
    world_size: int | None
    precision: str | None
    complete: bool
    problem: str | None  # why it is not usable: no marker yet (being written, or a crash mid-save), or damage
    size_bytes: int
    resume: bool  # the one a resumed run starts from

    def to_dict(self) -> dict:
        return asdict(self)


def checkpoints_folder(run: Path) -> Path:
    """A run's output_dir (its checkpoints/ inside) or the checkpoints folder itself."""
    return run / "checkpoints" if (run / "checkpoints").is_dir() else run


def list_checkpoints(run: Path) -> list[Listed]:
    """Every step_* folder of a run, oldest first, with its metadata and whether a resume would use it."""
    root = checkpoints_folder(run)
    listed = []
    for folder in sorted(root.glob("step_*")):
        match = STEP_FOLDER.fullmatch(folder.name)
        if not match or not folder.is_dir():
            continue
        step = int(match.group(1))
        marked = (folder / MARKER).is_file()
        problem = damage(folder, step) if marked else f"no {MARKER} marker (being written, or stopped mid-save)"
        meta = read_meta(folder) if marked and problem is None else {}
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        listed.append(
            Listed(
                path=str(folder),
                step=step,
                backend=meta.get("backend"),
                zero_stage=meta.get("zero_stage"),
                world_size=meta.get("world_size"),
                precision=meta.get("precision"),
                complete=problem is None,
                problem=problem,
                size_bytes=size,
                resume=False,
            )
        )
    listed.sort(key=lambda c: c.step)  # by number: a step past 9,999,999 has a longer name
    # the newest complete and intact folder: what find_resume chooses, from the same damage() checks
    newest = max((c for c in listed if c.complete), key=lambda c: c.step, default=None)
    return [replace(c, resume=True) if c is newest else c for c in listed]

"""A checkpoint folder as files, readable without torch: `output_dir/checkpoints/step_NNNNNNN/`, which counts
only once its `COMPLETE` marker exists. Rank 0 writes the marker (atomically, with the run's metadata and the size
of every file in the folder) after every rank's part is on disk; a folder whose marker is missing, not ours, or
whose files no longer have the sizes it lists is passed over for the one before it. `distsetup checkpoint ls`
and the trainer read folders through this module."""

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from distsetup.errors import DistsetupError

MARKER = "COMPLETE"
WITHDRAWN = "WITHDRAWN"  # why a checkpoint's marker was taken away (its weights trained to a loss of nan)
STEP_FOLDER = re.compile(r"step_(\d+)")


# How a checkpoint's files are laid out: "state.pt" (single, DDP), "fsdp" (DCP folders or full_state.pt), "zero0"
# (DeepSpeed ZeRO-0's one file), "zero" (ZeRO 1-3's files per rank), "universal" (DeepSpeed's universal folder, only
# ever written by `distsetup checkpoint convert`).
Layout = Literal["state.pt", "fsdp", "zero0", "zero", "universal"]


def layout(backend: str, zero_stage: int | None) -> Layout:
    """The layout backend `backend` (at ZeRO stage `zero_stage`) writes its checkpoints in."""
    if backend == "deepspeed":
        return "zero0" if zero_stage == 0 else "zero"
    own: dict[str, Layout] = {"single": "state.pt", "ddp": "state.pt", "fsdp": "fsdp"}
    return own[backend]


def converted_layout(backend: str) -> Layout:
    """The layout `distsetup checkpoint convert --to backend` writes: for DeepSpeed its universal folder, which any
    ZeRO stage and world size resumes from; else the backend's own."""
    return "universal" if backend == "deepspeed" else layout(backend, None)


def described_backend(backend: str, zero_stage: int | None) -> str:
    return backend if zero_stage is None else f"{backend} ZeRO-{zero_stage}"


@dataclass(frozen=True)
class Marker:
    """A checkpoint's COMPLETE marker: what wrote it, at which step and world size, and the size of every file."""

    backend: str
    step: int
    world_size: int
    zero_stage: int | None = None
    precision: str | None = None
    model: dict | None = None  # the run config's model section (absent before distsetup stored it)
    loss: float | None = None
    val_loss: float | None = None  # the validation loss, where the run evaluated at this step
    sampler: dict | None = None  # the ShardedSampler's state: where the data resumes
    user_code: str | None = None  # the folder of the user's own code (model.type or data.type python)
    layout: Layout | None = None  # set where the files are not in the backend's own layout (a converted checkpoint)
    converted_from: str | None = None
    # False: written before the step after it checked its weights (training.keep_checkpoints waits for that, and a
    # run resuming from it checks them at its first step); None: checked, or a checkpoint that needs no check
    confirmed: bool | None = None
    files: dict[str, int] = field(default_factory=dict)
    other_keys: dict[str, Any] = field(default_factory=dict)  # read with keys it does not know (another distsetup's)

    REQUIRED: ClassVar[tuple[str, ...]] = ("backend", "step", "world_size")

    @classmethod
    def from_json(cls, raw: Any) -> "Marker":
        """A marker read back; keys it does not know (an older or newer distsetup's) are kept aside, in other_keys,
        and written again by to_json."""
        if not isinstance(raw, dict) or any(key not in raw for key in cls.REQUIRED):
            raise ValueError(f"{MARKER} lacks {', '.join(cls.REQUIRED)}")
        if not isinstance(raw.get("files") or {}, dict):
            raise ValueError(f"{MARKER}'s files are not a mapping of names to sizes")
        known = {f.name for f in fields(cls)} - {"other_keys"}
        own = {key: value for key, value in raw.items() if key in known and value is not None}
        return cls(**own, other_keys={key: value for key, value in raw.items() if key not in known})

    @classmethod
    def read(cls, folder: Path) -> "Marker":
        return cls.from_json(json.loads((folder / MARKER).read_text()))

    def to_json(self) -> str:
        """Its keys (a loss that is NaN or infinite as null: JSON has no such numbers), then the other keys it was read
        with."""
        optional = ("val_loss", "user_code", "layout", "converted_from", "confirmed")
        own = {k: v for k, v in asdict(self).items() if k != "other_keys" and (v is not None or k not in optional)}
        for key in ("loss", "val_loss"):
            if isinstance(own.get(key), float) and not math.isfinite(own[key]):
                own[key] = None
        return json.dumps(own | {k: v for k, v in self.other_keys.items() if k not in own}, indent=2)

    @property
    def files_layout(self) -> Layout:
        """The layout the checkpoint's files are in."""
        return self.layout or layout(self.backend, self.zero_stage)

    @property
    def written_by(self) -> str:
        return described_backend(self.backend, self.zero_stage)

    @property
    def global_batch(self) -> int | None:
        return self.sampler.get("global_batch") if isinstance(self.sampler, dict) else None

    @property
    def data_position(self) -> dict | None:
        """The sampler's state where it says where the data resumes: the epoch and the samples read in it (an older
        marker: steps of its global batch); None where the marker holds none, or only part of one."""
        state = self.sampler
        if not isinstance(state, dict) or not _whole_numbers(state, "epoch"):
            return None
        return state if _whole_numbers(state, "samples") or _whole_numbers(state, "position", "global_batch") else None

    @property
    def legacy_hf_names(self) -> bool:
        """Whether it keeps a Hugging Face model under the names of the wrapper distsetup trained it in before it
        trained every model as itself (its stored model section still says layer_cls)."""
        return isinstance(self.model, dict) and self.model.get("type") == "hf" and "layer_classes" not in self.model


def _whole_numbers(state: dict, *keys: str) -> bool:
    return all(isinstance(state.get(key), int) and not isinstance(state.get(key), bool) for key in keys)


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


def passed_over(problem: str) -> str:
    """The line a run (or an export) says of a newer damaged checkpoint it passes over (find_resume's `problem`)."""
    return f"passed over damaged checkpoint {problem}"


def resume_point(root: Path) -> tuple[Path | None, list[str]]:
    """find_resume, where newer folders being damaged and none intact is an error: a run would silently start
    over."""
    resume, damaged = find_resume(root)
    if resume is None and damaged:
        raise DistsetupError(
            f"no intact checkpoint to resume from: {damaged[0]}.",
            "move the damaged folder aside, or start afresh with --no_resume.",
        )
    return resume, damaged


def beyond_newest(root: Path, keep: int) -> list[Path]:
    """The complete, intact checkpoint folders under `root` older than its `keep` newest ones (keep >= 1), and the
    withdrawn ones older than the newest: what training.keep_checkpoints removes. Folders without a marker (being
    written, or a crash's leftovers) and damaged ones are never among them."""
    intact = [(step, path) for step, path in _marked(root) if damage(path, step) is None]
    if not intact:
        return []
    withdrawn = [path for step, path in _stepped(root) if (path / WITHDRAWN).is_file() and step < intact[-1][0]]
    return [path for _, path in intact[: max(len(intact) - keep, 0)]] + withdrawn


def _finite(number: Any) -> float | None:
    return float(number) if isinstance(number, int | float) and math.isfinite(number) else None


def _marked(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step_* folder under `root` with a COMPLETE marker, oldest first."""
    return [(step, folder) for step, folder in _stepped(root) if (folder / MARKER).is_file()]


def _stepped(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step_* folder under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), d) for d in root.glob("step_*") if (m := STEP_FOLDER.fullmatch(d.name)))


def damage(path: Path, step: int) -> str | None:
    """What makes checkpoint folder `path` (step_`step`) unusable, or None: its marker must be ours and name `step`,
    and every file the marker lists must be there with the size it had when the checkpoint completed."""
    try:
        raw = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return f"{MARKER} is not a distsetup marker (unreadable or not JSON)"
    try:
        marker = Marker.from_json(raw)
    except (ValueError, TypeError) as e:
        return str(e) if isinstance(e, ValueError) else f"{MARKER} holds values of the wrong kind"
    if marker.step != step:
        return f"{MARKER} names step {marker.step}"
    for name, size in marker.files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, not the {size} it was written with"
    return None


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
    problem: str | None  # why it is not usable: no marker yet (being written, or a crash mid-save), damage, withdrawn
    size_bytes: int
    val_loss: float | None  # where the run evaluated at its step
    resume: bool  # the one a resumed run starts from
    best: bool  # the lowest val_loss of the complete ones

    def to_dict(self) -> dict:
        return asdict(self)


def checkpoints_folder(run: Path) -> Path:
    """A run's output_dir (its checkpoints/ inside) or the checkpoints folder itself."""
    return run / "checkpoints" if (run / "checkpoints").is_dir() else run


def one_step_folder(path: Path) -> int | None:
    """The step of `path` where it is one checkpoint's folder (step_N), as DeepSpeed's and the HF Trainer's users
    name a checkpoint; else None (a run's folder, or its checkpoints/)."""
    match = STEP_FOLDER.fullmatch(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def _unmarked(folder: Path) -> str:
    """Why a step folder has no marker: the trainer withdrew it (WITHDRAWN says why), it is another program's (an
    Accelerate save_state folder, by its random states), or it was never finished."""
    try:
        return f"withdrawn: {(folder / WITHDRAWN).read_text().strip()}"
    except OSError:
        pass
    if any(folder.glob("random_states_*.pkl")):
        return "an Accelerate save_state folder, not distsetup's trainer's (Accelerator.load_state reads it)"
    return f"no {MARKER} marker (being written, or stopped mid-save)"


def list_checkpoints(run: Path) -> list[Listed]:
    """Every step_* folder of a run, oldest first, with its metadata and whether a resume would use it; where `run`
    is one step_* folder, that one alone (what export and convert then read)."""
    root = checkpoints_folder(run)
    listed = []
    one_step = one_step_folder(run) is not None
    for folder in [run] if one_step else sorted(root.glob("step_*")):
        match = STEP_FOLDER.fullmatch(folder.name)
        if not match or not folder.is_dir():
            continue
        step = int(match.group(1))
        marked = (folder / MARKER).is_file()
        problem = damage(folder, step) if marked else _unmarked(folder)
        marker = Marker.read(folder) if marked and problem is None else None
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        listed.append(
            Listed(
                path=str(folder),
                step=step,
                backend=marker.backend if marker else None,
                zero_stage=marker.zero_stage if marker else None,
                world_size=marker.world_size if marker else None,
                precision=marker.precision if marker else None,
                complete=problem is None,
                problem=problem,
                size_bytes=size,
                val_loss=_finite(marker.val_loss) if marker else None,
                resume=False,
                best=False,
            )
        )
    listed.sort(key=lambda c: c.step)  # by number: a step past 9,999,999 has a longer name
    if one_step:  # a resume reads the run's folder, not this one
        return listed
    # the newest complete and intact folder: what find_resume chooses, from the same damage() checks
    complete = [c for c in listed if c.complete]
    newest = max(complete, key=lambda c: c.step, default=None)
    # the lowest validation loss (the earliest of equals), among those evaluated at their step
    best = min((c for c in complete if c.val_loss is not None), key=lambda c: c.val_loss or 0.0, default=None)
    return [replace(c, resume=c is newest, best=c is best) for c in listed]

"""Saving and loading checkpoints: atomic writes, RNG state and resume checks (the folder's layout and its
COMPLETE marker: distsetup/formats/checkpoint_folder.py).

Rank 0 writes the marker after a barrier that every rank reaches only when its own part is on disk. A crash
mid-save therefore leaves the previous complete checkpoint as the newest, and a folder damaged later is passed
over for the one before it, which every rank decides alike (rank 0 decides, the others follow) before any
collective.
"""

import contextlib
import copy
import os
import random
import shutil
import sys
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from distsetup.errors import DistsetupError, last_line
from distsetup.formats.checkpoint_folder import MARKER, WITHDRAWN, Marker, beyond_newest, file_sizes, step_dir
from distsetup.training.launch_env import World
from distsetup.training.world import barrier, is_lost_contact


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def copied_to_cpu(state):
    """`state` with every tensor copied to the CPU: what a background write reads while training goes on."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: copied_to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(copied_to_cpu(value) for value in state)
    return copy.deepcopy(state)


# what sizes the weights, beside the type (a python model's sizes are its builder's: a mismatch shows when loading)
SHAPE_KEYS = {"gpt": ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"), "hf": (), "python": ("builder",)}


def check_compatible(marker: Marker, path: Path, model: dict) -> None:
    """A checkpoint of a model of another shape than the run config's `model` section is an error up front (before
    any collective load could fail on one rank and leave the others waiting)."""
    stored = marker.model  # checkpoints before distsetup stored it: the load itself finds out
    if not isinstance(stored, dict):
        return
    if marker.legacy_hf_names:
        raise DistsetupError(
            f"checkpoint {path} keeps the Hugging Face model under the names of the wrapper an older distsetup "
            "trained it in (hf.*); this one trains it under its own names.",
            f"export it (`distsetup checkpoint export {path.parent.parent} -o DIR --format hf`), set model.hf_path "
            "to DIR and start afresh with --no_resume.",
        )
    keys = ("type", *SHAPE_KEYS.get(model["type"], ()))
    for key in keys:
        if stored.get(key) != model[key]:
            raise DistsetupError(
                f"checkpoint {path} holds a model with model.{key} {stored.get(key)}; this run config says "
                f"{model[key]}.",
                "resume with the run config it was trained with, or start afresh in another training.output_dir.",
            )


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointing(Protocol):
    """What writing and reading a checkpoint asks of a backend (training/backends/base.py)."""

    def save(self, path: Path) -> None: ...

    def start_save(self, path: Path) -> list[Future]: ...

    def checkpoint_complete(self, path: Path) -> None: ...

    def checkpoint_withdrawn(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...


def save_checkpoint(backend: Checkpointing, root: Path, world: World, marker: Marker, keep: int | None = None) -> Path:
    """Every rank writes its part; the COMPLETE marker follows only once all have finished. Then, with `keep`,
    rank 0 removes the complete checkpoints older than the `keep` newest."""
    pending = start_checkpoint(backend, root, world, marker, keep, background=False)
    pending.finish(world, backend)
    return pending.path


def start_checkpoint(
    backend: Checkpointing,
    root: Path,
    world: World,
    marker: Marker,
    keep: int | None,
    background: bool,
    confirmed: bool = True,
) -> "PendingCheckpoint":
    """Every rank starts writing its part of checkpoint `marker.step`: in the background (training.async_checkpoint),
    once the backend has copied what it writes, or else whole before returning. The checkpoint is complete only
    once PendingCheckpoint.finish() has seen every rank's part on disk and written the marker. Not `confirmed`: the
    older ones stay until confirm() (the trainer's, once the next step's loss is a number)."""
    path = step_dir(root, marker.step)
    with disk_errors(path):
        if world.is_main:
            if path.exists():  # leftovers of a save that crashed at this very step
                shutil.rmtree(path)
            path.mkdir(parents=True)
    barrier()
    with disk_errors(path):
        atomic_save(rng_state(), path / f"rng_rank{world.rank}.pt")
        if background:
            writes = backend.start_save(path)
        else:
            backend.save(path)
            writes = []
    return PendingCheckpoint(path, marker, writes, keep, confirmed)


@dataclass
class PendingCheckpoint:
    """A checkpoint whose parts are being written: `writes` complete when this rank's files are on disk."""

    path: Path
    marker: Marker  # all but the files' sizes, which it gets once they are on disk
    writes: list[Future]
    keep: int | None
    confirmed: bool = True  # known good: training.keep_checkpoints may remove older ones for it
    finished: bool = False

    def written_here(self) -> bool:
        return all(write.done() for write in self.writes)

    def finish(self, world: World, backend: Checkpointing) -> None:
        """Every rank, at the same step: wait for this rank's writes, then rank 0 writes the COMPLETE marker
        (after a barrier: every part is on disk) and removes what training.keep_checkpoints lets go."""
        with disk_errors(self.path):
            for write in self.writes:
                write.result()  # a failed background write raises here
        barrier()
        if world.is_main:
            with disk_errors(self.path):
                marker = replace(self.marker, files=file_sizes(self.path))
                atomic_write_text(self.path / MARKER, marker.to_json())
                backend.checkpoint_complete(self.path)
        barrier()
        self.finished = True
        if self.confirmed:
            self._remove_older(world)

    def confirm(self, world: World) -> None:
        """Every rank: its weights trained a step to a loss that is a number. Its marker says so (once written),
        and the older ones may go for it."""
        self.confirmed = True
        self.marker = replace(self.marker, confirmed=None)
        if self.finished:
            if world.is_main:
                with disk_errors(self.path):
                    amend_marker(self.path, confirmed=None)
            self._remove_older(world)

    def withdraw(self, world: World, backend: Checkpointing, reason: str) -> None:
        """Every rank: its weights trained a step to a loss that is not a number. Once every rank's writes have
        ended, rank 0 says why in WITHDRAWN and takes its marker away, so that no run resumes from it (the one
        before it is still there: nothing was removed for it), and tells its format's own tools."""
        for write in self.writes:
            with contextlib.suppress(BaseException):
                write.result()
        barrier()
        if world.is_main:
            with disk_errors(self.path):
                atomic_write_text(self.path / WITHDRAWN, reason)
                (self.path / MARKER).unlink(missing_ok=True)
                backend.checkpoint_withdrawn(self.path)
        barrier()

    def _remove_older(self, world: World) -> None:
        if self.keep and world.is_main:
            remove_older(self.path.parent, self.keep)


def remove_older(root: Path, keep: int) -> None:
    """training.keep_checkpoints: remove the complete checkpoints older than the `keep` newest (and withdrawn ones
    older than the newest); a removal that fails is said, never fatal (the new checkpoint is complete either way)."""
    for old in beyond_newest(root, keep):
        try:
            (old / MARKER).unlink(missing_ok=True)  # first: a removal cut short leaves a folder no resume picks
        except OSError as e:
            print(f"note: training.keep_checkpoints could not remove {old}: {e.strerror or e}", flush=True)
            continue
        shutil.rmtree(old, ignore_errors=True)


def and_dcp_failures(*kinds: type[BaseException]) -> tuple[type[BaseException], ...]:
    """`kinds` and DCP's CheckpointException (a BaseException, no Exception) where the run has imported DCP: a run
    that never saves through DCP does not pay for its import (1.5 s). An `except` clause evaluates it when an error
    reaches it."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (*kinds, api.CheckpointException) if api else kinds


@contextlib.contextmanager
def disk_errors(path: Path):
    """A failed write (a full disk, a quota, a folder gone) as one line naming the folder and the free space."""
    try:
        yield
    except and_dcp_failures(OSError, RuntimeError) as e:  # torch.save: RuntimeError
        if is_lost_contact(e):  # DeepSpeed and DCP save through collectives: a peer died, not the disk
            raise
        reason = e.strerror if isinstance(e, OSError) and e.strerror else last_line(e)
        raise DistsetupError(
            f"cannot write checkpoint {path}: {reason}; {free_space(path)} free on that disk.",
            "free space there or set training.output_dir to a disk with room; the previous "
            "complete checkpoint is untouched and the run resumes from it.",
        ) from None


def free_space(path: Path) -> str:
    for folder in (path, *path.parents):
        try:
            return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB"
        except OSError:
            continue
    return "unknown"


def amend_marker(folder: Path, **changes) -> None:
    """A complete checkpoint's marker, as written, with `changes` (confirmed, a later evaluation's val_loss)."""
    atomic_write_text(folder / MARKER, replace(Marker.read(folder), **changes).to_json())


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_checkpoint(backend: Checkpointing, path: Path, world: World, model: dict) -> Marker:
    """Restore model, optimizer and scheduler (the backend's job), then this rank's RNG; returns its marker.
    Damage that left every size intact shows only here, as one line naming the folder; a model section changed
    since the checkpoint (`model`, the run config's: model.args of a python model) is named instead where the load
    fails, since every checkpoint of the run would fail alike."""
    marker = Marker.read(path)
    rng_file = path / f"rng_rank{world.rank}.pt"
    try:
        backend.load(path)
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    except and_dcp_failures(Exception) as e:  # whatever a damaged file makes torch, pickle or DeepSpeed raise
        if is_lost_contact(e):  # DeepSpeed and DCP load through collectives: a peer died, not the checkpoint
            raise
        reason = e.problem if isinstance(e, DistsetupError) else last_line(e).rstrip(".")
        if changed := model_changes(marker.model, model):
            raise DistsetupError(
                f"cannot load checkpoint {path}: the run config's model section is not the one it was trained with "
                f"({'; '.join(changed)}): {reason.rstrip('.')}.",
                "resume with the model section it was trained with, or start afresh in another training.output_dir "
                f"(or with --no_resume); where it is as it was, move {path} aside to resume from the one before it.",
                alike_on_every_rank=True,  # every rank's model differs alike: said once per node
            ) from None
        if isinstance(e, DistsetupError):
            raise
        raise DistsetupError(
            f"cannot load checkpoint {path}: {reason}.",
            f"move {path} aside to resume from the checkpoint before it, or start afresh with --no_resume.",
        ) from None
    return marker


# The model section's keys that make its weights (a python model's: its builder and their arguments; a Hugging Face
# model's: its folder)
WEIGHT_KEYS = {**SHAPE_KEYS, "python": ("builder", "args"), "hf": ("hf_path",)}


def model_changes(stored: dict | None, model: dict) -> list[str]:
    """How the run config's model section `model` differs from a checkpoint's (`stored`; None: before distsetup
    stored it) in what makes its weights: "model.args.z_bits 16 there, 8 here" (a dropout or a tokenizer's path
    changes none; a key an older marker lacks is no change)."""
    if not isinstance(stored, dict):
        return []
    keys = [key for key in ("type", *WEIGHT_KEYS.get(model["type"], ())) if key in stored]
    changes = []
    for key in keys:
        there, here = stored[key], model.get(key)
        if isinstance(there, dict) and isinstance(here, dict):
            changes += [
                f"model.{key}.{name} {there.get(name)} there, {here.get(name)} here"
                for name in sorted(there.keys() | here.keys())
                if there.get(name) != here.get(name)
            ]
        elif there != here:
            changes.append(f"model.{key} {there} there, {here} here")
    return changes

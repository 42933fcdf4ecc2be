"""Checkpoint folders: naming, the COMPLETE marker, atomic writes, RNG state and resume checks.

A checkpoint is `output_dir/checkpoints/step_NNNNNNN/`. It counts only once `COMPLETE` exists: rank 0
writes it (atomically, holding the run's metadata) after a barrier that every rank reaches only when its
own part is on disk. A crash mid-save therefore leaves the previous complete checkpoint as the newest.
"""

import json
import os
import random
import shutil
from pathlib import Path

import torch

from distsetup.errors import DistsetupError
from distsetup.output import write_atomic
from distsetup.training.world import World, barrier

MARKER = "COMPLETE"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_complete(root: Path) -> Path | None:
    """The newest checkpoint folder that has its COMPLETE marker (DeepSpeed's `latest` is never read)."""
    done = [d for d in root.glob("step_*") if (d / MARKER).is_file()] if root.is_dir() else []
    return max(done, key=lambda d: int(d.name.split("_")[1]), default=None)


def read_meta(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


def check_compatible(meta: dict, path: Path, backend: str, world_size: int, zero_stage) -> None:
    """A checkpoint from another backend (or a ZeRO world it cannot be split for) is an error up front."""
    if meta["backend"] != backend:
        raise DistsetupError(f"checkpoint {path} was written by backend {meta['backend']}, this run uses {backend}.",
                             f"use backend {meta['backend']}, another training.output_dir, or --no_resume "
                             "(or --export it and start this backend with --init_from).")
    if backend == "deepspeed" and (meta["world_size"] != world_size or meta.get("zero_stage") != zero_stage):
        raise DistsetupError(f"checkpoint {path} is ZeRO-{meta.get('zero_stage')} on {meta['world_size']} ranks; "
                             f"this run is ZeRO-{zero_stage} on {world_size}.",
                             "resume with the same DeepSpeed file and world size, or --export it and use --init_from.")


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


def save_checkpoint(backend, root: Path, step: int, world: World, meta: dict) -> Path:
    """Every rank writes its part; the COMPLETE marker follows only once all have finished."""
    path = step_dir(root, step)
    if world.is_main:
        if path.exists():  # leftovers of a save that crashed at this very step
            shutil.rmtree(path)
        path.mkdir(parents=True)
    barrier()
    backend.save(path)
    atomic_save(rng_state(), path / f"rng_rank{world.rank}.pt")
    barrier()
    if world.is_main:
        write_atomic(path / MARKER, json.dumps({**meta, "step": step, "world_size": world.size}, indent=2))
    barrier()
    return path


def load_checkpoint(backend, path: Path, world: World) -> dict:
    """Restore model, optimizer and scheduler (the backend's job), then this rank's RNG; returns the metadata."""
    meta = read_meta(path)
    backend.load(path)
    rng_file = path / f"rng_rank{world.rank}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return meta

"""`distsetup checkpoint convert`: the newest complete checkpoint of a run rewritten as one that another backend
resumes as its own, at any world size, with the whole training state (weights, AdamW moments and steps, scheduler,
fp16 loss scale, data position, each rank's RNG): single/DDP's state.pt, FSDP's DCP folders, or DeepSpeed's
universal folder, which every ZeRO 1-3 run loads. The source is only read; the new output folder is written
whole or not at all.

A run resumes another backend's checkpoint by itself (train.py converts in memory); convert does it once, offline,
so the new run starts without waiting for a conversion and the result can be copied where the run will be. It
reads and writes one tensor at a time (streamed_io.py): its memory does not grow with the model.
"""

import shutil
from dataclasses import replace
from pathlib import Path

import torch

from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import MARKER, Layout, Marker, converted_layout, file_sizes, step_dir
from distsetup.training.checkpoint import universal_folder
from distsetup.training.checkpoint.export import checkpoint_and_model, read_errors, write_new_folder
from distsetup.training.checkpoint.files import atomic_write_text
from distsetup.training.checkpoint.named_state import lazy_state
from distsetup.training.checkpoint.streamed_io import save_dcp_streamed, save_streamed
from distsetup.training.optim import numbered
from distsetup.training.world import ranks


def convert(run: Path, to: str, out: Path) -> tuple[Path, Path]:
    """Write the newest complete checkpoint of `run` into the new output folder `out` as backend `to` writes it;
    returns (the checkpoint read, the one written)."""
    path, model = checkpoint_and_model(run, out)
    marker = Marker.read(path)
    source, target = marker.files_layout, converted_layout(to)
    if source == target:
        raise DistsetupError(
            f"{path} ({marker.written_by}) already resumes under {to} as it is, at any world size.",
            f"point the {to} run's training.output_dir at {run}.",
        )
    written = step_dir(out / "checkpoints", marker.step)

    def write(folder: Path) -> None:
        checkpoint = step_dir(folder / "checkpoints", marker.step)
        _write(lazy_state(path, source, parameter_groups(model, marker.user_code)), target, checkpoint, marker)
        for rng in path.glob("rng_rank*.pt"):
            shutil.copyfile(rng, checkpoint / rng.name)
        converted = replace(
            marker,
            backend=to,
            zero_stage=None,
            layout="universal" if target == "universal" else None,
            converted_from=f"{marker.written_by}, {ranks(marker.world_size)}",
            files=file_sizes(checkpoint),
        )
        atomic_write_text(checkpoint / MARKER, converted.to_json())

    with read_errors(path, "convert"):
        write_new_folder(out, write)
    return path, written


def _write(state: dict, target: Layout, checkpoint: Path, marker: Marker) -> None:
    """Named state `state` (its tensors Lazy) as the files of layout `target` in the new folder `checkpoint`, one
    tensor in memory at a time."""
    if target == "universal":
        universal_folder.write(state, checkpoint, marker)
        return
    checkpoint.mkdir(parents=True)
    if target == "state.pt":
        whole = {"model": state["model"], "optimizer": numbered(state["optimizer"]), "scheduler": state["scheduler"]}
        if state["scaler"]:
            whole["scaler"] = state["scaler"]
        save_streamed(whole, checkpoint / "state.pt")
        return
    save_dcp_streamed(state["model"], checkpoint / "model")  # FSDP's own layout; it reshards for any world size
    save_dcp_streamed(state["optimizer"], checkpoint / "optim")
    torch.save({"scheduler": state["scheduler"]}, checkpoint / "scheduler.pt")


def parameter_groups(model: dict, user_code: str | None = None) -> list[list[str]]:
    """The parameter names in each optimizer param group (training.optim.param_groups) of the model a run
    config's `model` section describes, built on the meta device (model.builder's module imported from `user_code`,
    the folder the training found it in, else this one or PYTHONPATH)."""
    from distsetup.formats.runconfig_load import model_config
    from distsetup.training.model.build import architecture_on_meta
    from distsetup.training.optim import names_by_group, param_groups
    from distsetup.training.user_code import make_importable

    section = model_config(model)
    if section.builder:
        make_importable(Path(user_code) if user_code and Path(user_code).is_dir() else None)
    built = architecture_on_meta(section)
    return names_by_group(built, param_groups(built, 0.0))

"""The whole training state of a checkpoint keyed by parameter names: weights, AdamW moments and steps, the
scheduler and the fp16 loss scaler, in the form torch.distributed.checkpoint's full state dicts take. Every backend
reads any other's checkpoint through it: the torch backends load it with set_model_state_dict and
set_optimizer_state_dict, DeepSpeed ZeRO 1-3 as a universal folder written from it (universal_folder.py).

A checkpoint's layout says what its files look like; two backends with the same layout load each other's
checkpoints as they are, at any world size (except ZeRO 1-3's, whose files are per rank).
"""

import tempfile
from pathlib import Path

import torch

from distsetup.errors import DistsetupError
from distsetup.training import universal_folder
from distsetup.training.weight_stream import plain_name

ZERO0_FILE = "mp_rank_00_model_states.pt"  # ZeRO-0 keeps the module and the whole optimizer in it


def layout(backend: str, zero_stage: int | None) -> str:
    """ "state.pt" (single, DDP), "fsdp" (DCP folders or full_state.pt), "zero0" (DeepSpeed ZeRO-0's one file),
    "zero" (ZeRO 1-3's files per rank) or "universal" (DeepSpeed's universal folder)."""
    if backend == "deepspeed":
        return "zero0" if zero_stage == 0 else "zero"
    return {"single": "state.pt", "ddp": "state.pt", "fsdp": "fsdp"}[backend]


def checkpoint_layout(meta: dict) -> str:
    """The layout of the checkpoint whose COMPLETE marker is `meta` (a converted one says it)."""
    return meta.get("layout") or layout(meta["backend"], meta.get("zero_stage"))


def described(backend: str, zero_stage: int | None) -> str:
    return backend if zero_stage is None else f"{backend} ZeRO-{zero_stage}"


def refuse_unreadable(path: Path, meta: dict) -> None:
    """ZeRO-0 in bf16 or fp16 keeps its optimizer in DeepSpeed's own wrapper, which only DeepSpeed reads back."""
    if checkpoint_layout(meta) == "zero0" and meta.get("precision") != "fp32":
        raise DistsetupError(
            f"checkpoint {path} is DeepSpeed ZeRO-0 in {meta.get('precision')}, whose optimizer state distsetup "
            "converts from fp32 only.",
            "resume it under ZeRO-0 with its DeepSpeed file, or --export its weights and start with --init_from.",
        )


def named_state(path: Path, source: str, groups: list[list[str]]) -> dict:
    """{"model", "optimizer", "scheduler", "scaler"} of checkpoint folder `path` in layout `source` ("zero" folders
    are read once converted to "universal"), the optimizer keyed by parameter names. `groups`: the parameter names
    in each param group of the optimizer that loads it, in its order; state.pt and ZeRO-0 number the parameters in
    that order (every backend builds its groups with training.optim.param_groups, so the numbers mean the same)."""
    if source == "universal":
        return universal_folder.read(path, groups)
    if source in ("state.pt", "zero0"):
        ours = source == "state.pt"  # else DeepSpeed's names
        state = torch.load(path / ("state.pt" if ours else ZERO0_FILE), map_location="cpu", weights_only=False)
        return {
            "model": {plain_name(k): v for k, v in state["model" if ours else "module"].items()},
            "optimizer": _named(state["optimizer"], [name for names in groups for name in names]),
            "scheduler": state["scheduler" if ours else "lr_scheduler"],
            "scaler": state.get("scaler"),
        }
    if (path / "full_state.pt").exists():
        state = torch.load(path / "full_state.pt", map_location="cpu", weights_only=False)
        return {**state, "scaler": None}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        parts = {}
        for part in ("model", "optim"):
            dcp_to_torch_save(path / part, Path(tmp) / f"{part}.pt")
            parts[part] = torch.load(Path(tmp) / f"{part}.pt", map_location="cpu", weights_only=False)
    scheduler = torch.load(path / "scheduler.pt", weights_only=False)["scheduler"]
    return {"model": parts["model"], "optimizer": parts["optim"], "scheduler": scheduler, "scaler": None}


def numbered(named: dict) -> dict:
    """A named optimizer state dict as torch's own optimizer numbers it: its parameters in group order."""
    number = {name: i for i, name in enumerate(name for group in named["param_groups"] for name in group["params"])}
    groups = [{**group, "params": [number[name] for name in group["params"]]} for group in named["param_groups"]]
    return {"state": {number[name]: moments for name, moments in named["state"].items()}, "param_groups": groups}


def _named(numbered: dict, order: list[str]) -> dict:
    """A torch optimizer's state dict with its numbered parameters named after `order`."""
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in numbered["param_groups"]]
    return {"state": {order[i]: moments for i, moments in numbered["state"].items()}, "param_groups": groups}

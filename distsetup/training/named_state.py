"""The whole training state of a single, DDP or FSDP checkpoint keyed by parameter names: weights, AdamW moments
and steps, the scheduler and the fp16 loss scaler, in the form torch.distributed.checkpoint's full state dicts
take, which each of these backends loads. How a run resumes a checkpoint another of them wrote."""

import tempfile
from pathlib import Path

import torch

from distsetup.training.weight_stream import plain_name

TORCH_BACKENDS = ("single", "ddp", "fsdp")
FILES = {"single": "state.pt", "ddp": "state.pt", "fsdp": "fsdp"}  # backends whose checkpoints share a layout


def named_state(path: Path, backend: str, order: list[str]) -> dict:
    """{"model", "optimizer", "scheduler", "scaler"} of checkpoint folder `path` written by `backend`, the optimizer
    keyed by parameter names. `order`: the parameter names in the optimizer's order, which the single/DDP file
    numbers (both sides build their groups with training.optim.param_groups, so the numbers mean the same)."""
    if FILES[backend] == "state.pt":
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        numbered = state["optimizer"]
        optimizer = {
            "state": {order[i]: moments for i, moments in numbered["state"].items()},
            "param_groups": [
                {**group, "params": [order[i] for i in group["params"]]} for group in numbered["param_groups"]
            ],
        }
        model = {plain_name(k): v for k, v in state["model"].items()}
        return {"model": model, "optimizer": optimizer, "scheduler": state["scheduler"], "scaler": state.get("scaler")}
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

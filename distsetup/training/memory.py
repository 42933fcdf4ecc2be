"""Bytes a rank really holds, counted from the tensors themselves (shared storage counted once)."""

from typing import Iterable

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2); a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable) -> int:
    """Bytes of the storages behind `tensors`, each storage once (views of one flat buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def state_tensors(state) -> list:
    """Every tensor in a (nested) optimizer state."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in state_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in state_tensors(v)]
    return []


def grad_bytes(params) -> int:
    return tensor_bytes(p.grad for p in params if p.grad is not None)

"""Bytes a rank really holds, counted from the tensors themselves (shared storage counted once), and the memory the
machine (or its container) has for it."""

import contextlib
import os
import resource
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from distsetup.training.cgroup_memory import limiting_group


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2); a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


STATUS, CLEAR_REFS, MEMINFO = Path("/proc/self/status"), Path("/proc/self/clear_refs"), Path("/proc/meminfo")


def host_peak_bytes() -> int:
    """This process's peak resident memory since it started or since reset_host_peak (Linux's VmHWM; elsewhere
    ru_maxrss, which only ever rises)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_host_peak() -> None:
    """Start host_peak_bytes' count again from the memory resident now (Linux: 5 to /proc/self/clear_refs)."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pass


class TrainingPeak:
    """This rank's peak resident memory in training, every checkpoint's own left out (summary.json's
    host_peak_bytes): the high-water mark kept before each checkpoint and started again after it. After a checkpoint
    and no step since (the last one, a background one finishing), what the mark holds is that checkpoint's (its
    staged copy, its writer), so it counts only where steps ran since. A background checkpoint's staged copy,
    resident while later steps run, counts in theirs."""

    def __init__(self) -> None:
        self.bytes = 0
        self.counted_after_step = -1  # the step of the last checkpoint

    @contextlib.contextmanager
    def left_out(self, step: int) -> Iterator[None]:
        """The peak so far kept, and the count started again after the block (a checkpoint at `step`)."""
        self.note(step)
        try:
            yield
        finally:
            reset_host_peak()
            self.counted_after_step = step

    def note(self, step: int) -> None:
        """The peak since the count last started, kept where steps ran since (the run is at `step`)."""
        if step > self.counted_after_step:
            self.bytes = max(self.bytes, host_peak_bytes())


def available_memory() -> int:
    """Bytes the kernel could hand out now (MemAvailable counts reclaimable caches; free pages do not), within what
    this process's memory cgroup (a container's, a pod's) has left, where that is less."""
    available, group = _meminfo("MemAvailable"), limiting_group()
    return available if group is None else min(available, group.free)


def device_memory_per_rank(device: torch.device, local_processes: int) -> int:
    """The memory a rank trains in: its GPU's whole memory, or on the CPU its share of the node's (MemTotal, or the
    memory cgroup's limit where that is less, over this node's `local_processes`). The same on every rank of a kind
    of machine, and from one run to the next."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total, group = _meminfo("MemTotal"), limiting_group()
    return (total if group is None else min(total, group.limit)) // local_processes


def _meminfo(key: str) -> int:
    """/proc/meminfo's `key`, in bytes; where it cannot be read, the machine's physical memory."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def full_shape(parameter: torch.Tensor) -> torch.Size:
    """A parameter's own shape, also where ZeRO-3 holds a partition of it (deepspeed.zero.Init: its data is empty,
    its shape in ds_shape)."""
    return getattr(parameter, "ds_shape", parameter.shape)


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


class SavedActivations:
    """Bytes autograd saves for backward while active (a forward pass), parameters left out.

    Each storage counts once. Parameters are recognised when a tensor is saved, from the storages of
    `model.parameters()` at that moment: FSDP2 and ZeRO-3 gather a parameter into a fresh storage for
    the duration of its module's forward, and those are weights, not activations.
    """

    def __init__(self, model):
        self.model, self.bytes, self._seen = model, 0, set()

    def _pack(self, t):
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._seen and ptr not in {_storage_ptr(p) for p in self.model.parameters()}:
                self._seen.add(ptr)
                self.bytes += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            pass
        return t

    def __enter__(self):
        import torch.autograd.graph

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _storage_ptr(p) -> int:
    p = _local(p)
    return p.untyped_storage().data_ptr() if p.numel() else -1


def every_ranks(mine: dict[str, int], world_size: int) -> dict[str, list[int]]:
    """Each figure of `mine` (name -> this rank's number) as every rank's, in rank order: a collective where a
    process group exists."""
    gathered = [mine]
    if torch.distributed.is_initialized():
        gathered = [{}] * world_size
        torch.distributed.all_gather_object(gathered, mine)
    return {name: [figures[name] for figures in gathered] for name in mine}

"""The memory this process's control group allows it: a container's limit, a Kubernetes pod's `resources.limits`, a
SLURM job's `--mem` under cgroup confinement. /proc/meminfo tells the node's memory whatever the limit, so a run that
read it alone would plan for memory it cannot have and meet the OOM killer instead of a refusal.

Linux's two layouts: cgroup v2 (one hierarchy: memory.max, memory.current) and v1 (a memory hierarchy of its own:
memory.limit_in_bytes, memory.usage_in_bytes). A limit set on a parent group (a pod's, around its containers') binds
too, so the tightest one on the path counts."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CGROUP_MOUNT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# v1 writes "no limit" as the largest page-aligned 64-bit number; anything from 2^62 on is no limit in practice
NO_LIMIT = 2**62


@dataclass(frozen=True)
class Layout:
    """Where one cgroup version keeps a group's limit, usage, most usage and statistics (the page cache it may
    drop)."""

    hierarchy: str  # the folder under CGROUP_MOUNT ("" for v2's unified one)
    limit: str
    usage: str
    peak: str
    reclaimable: str  # the memory.stat key of the inactive page cache, which the kernel drops before it kills

    @property
    def mount(self) -> Path:
        return CGROUP_MOUNT / self.hierarchy if self.hierarchy else CGROUP_MOUNT


V2 = Layout("", "memory.max", "memory.current", "memory.peak", "inactive_file")
V1 = Layout(
    "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes", "total_inactive_file"
)


@dataclass(frozen=True)
class GroupMemory:
    """The tightest memory limit on this process's cgroup path, and the least any limited group on it has left (a
    pod's other containers use its limit too): both bind."""

    limit: int
    free: int


def limiting_group() -> GroupMemory | None:
    """The memory limits that bind this process, or None where there is none (or nothing can be read: not Linux).
    Where a v1 memory line and v2's line are both listed (a hybrid layout), the first that names a limit counts."""
    for layout, folder in _memory_groups():
        if (found := _tightest(layout, folder)) is not None:
            return found
    return None


def _memory_groups() -> Iterator[tuple[Layout, Path]]:
    """The memory cgroups /proc/self/cgroup lists, each with its folder. Inside a container's cgroup namespace the
    mount shows its own group as the root, while /proc may name the path outside it: the mount's root is then the
    group."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if line.startswith("0::"):
            layout = V2
        elif "memory" in controllers.split(","):
            layout = V1
        else:
            continue
        group = layout.mount / path.lstrip("/")
        yield layout, group if group.is_dir() else layout.mount


def _tightest(layout: Layout, group: Path) -> GroupMemory | None:
    """The limits of `group` and its parents."""
    folders = [group, *group.parents[: len(group.relative_to(layout.mount).parts)]]
    limited = [(limit, folder) for folder in folders if (limit := _number(folder / layout.limit)) is not None]
    limited = [(limit, folder) for limit, folder in limited if limit < NO_LIMIT]
    if not limited:
        return None
    return GroupMemory(min(limit for limit, _ in limited), min(_free(layout, *pair) for pair in limited))


def _free(layout: Layout, limit: int, folder: Path) -> int:
    """What a group of `limit` has left: the limit less its usage, less the page cache the kernel drops first."""
    used = (_number(folder / layout.usage) or 0) - _stat(folder / "memory.stat", layout.reclaimable)
    return max(0, limit - max(0, used))


def _number(path: Path) -> int | None:
    """A cgroup file's number; None where it is "max" (v2's no limit) or cannot be read."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0

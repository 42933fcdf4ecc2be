"""The processes a test started, and all they started in turn (DataLoader workers, fork servers, torchrun's ranks in
sessions of their own), from /proc."""

from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def running(pids) -> list[int]:
    """Those of `pids` still running (a zombie has ended)."""
    return [pid for pid in pids if (fields := _stat(pid)) and fields[0] != "Z"]


def parent(pid: int) -> int | None:
    """`pid`'s parent; none where it is gone."""
    return int(fields[1]) if (fields := _stat(pid)) else None


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name: state, parent pid, ...; none where it is gone."""
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []

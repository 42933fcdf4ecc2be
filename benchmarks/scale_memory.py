"""Benchmark 7: each rank's peak host memory at set-up and in training under FSDP2 and ZeRO-3, at 1, 2, 4 and 8
processes, for a model of about 200M parameters: whether any rank still holds the whole model.

The figures are each rank's resident-memory high-water mark (summary.json's host_peak_bytes: in set-up, and in
training, checkpoints left out) less a bare process's (python, torch, distsetup and the backend's library imported),
in units of the whole model in fp32 (4 bytes a parameter), beside the sharded state (16 bytes a parameter / W: fp32
weights, gradients and AdamW's two moments). On a CPU the shards live in host memory; on a GPU this is the host's
part only. Goal (issue 37): at W=8 every rank but 0 peaks at <= 0.75 of the whole model, rank 0 at <= 1.25.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, launch, record, table

from distsetup.formats.deepspeed import unset_sizes
from distsetup.planning.models import gpt_params
from distsetup.training import cgroup_memory

# a bare process: python, torch, distsetup's trainer and the backend's library imported, nothing built
BARE = "import resource, torch, distsetup.training.trainer{}; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
# what a run of each backend imports beside the trainer: FSDP2 (with DTensor and DCP, its checkpoints) or DeepSpeed
LIBRARY = {
    "fsdp": ", torch.distributed.fsdp, torch.distributed.tensor, torch.distributed.checkpoint",
    "zero3": ", deepspeed",
}
GOAL_OTHERS, GOAL_RANK0 = 0.75, 1.25
RECOMPUTED = {"none": "", "full": ", activation checkpointing full (each block's activations recomputed)"}


class MemoryCgroup:
    """A memory cgroup of `limit_bytes` inside this process's own (cgroup v1's memory hierarchy, or v2's where its
    memory controller is delegated), as a container's limit, removed on leaving. Needs the right to make groups there
    (root, or a delegated subtree)."""

    def __init__(self, limit_bytes: int):
        if (own := cgroup_memory.own_group()) is None:
            raise SystemExit("--memory_limit: this process is in no memory cgroup")
        self.layout, self.group = own[0], own[1] / f"scale-memory-{os.getpid()}"
        try:
            self.group.mkdir()
        except OSError as e:
            raise SystemExit(f"--memory_limit: cannot make a memory cgroup at {self.group} ({e})") from e
        try:
            (self.group / self.layout.limit).write_text(str(limit_bytes))
        except OSError as e:
            self.group.rmdir()
            raise SystemExit(f"--memory_limit: cannot limit {self.group} ({e}): is the memory controller on?") from e

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *_) -> None:
        self.group.rmdir()

    def join(self) -> None:
        """Put the calling process (a launcher, before it starts) in the group: its children follow."""
        (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        """The most the group has held at once (the kernel's count, page cache included)."""
        return int((self.group / self.layout.peak).read_text())


def run(backend: str, processes: int, a, work: Path, join_cgroup=None) -> dict:
    """One run's summary.json: `processes` ranks, `a.steps` steps of micro-batch 1 (its launcher put in a memory
    cgroup by `join_cgroup`, where given)."""
    out = work / f"{backend}-{processes}"
    overrides = [
        f"model.n_layer={a.n_layer}",
        f"model.n_embd={a.n_embd}",
        f"model.n_head={a.n_head}",
        "model.block_size=64",
        f"training.max_steps={a.steps}",
        "training.micro_batch_size=1",
        "training.gradient_accumulation_steps=1",
        "training.checkpoint_interval=1000",
        "training.warmup_steps=0",
        "training.precision=fp32",
        f"training.activation_checkpointing={a.activation_checkpointing}",
        f"training.output_dir={out}",
    ]
    if backend == "zero3":
        ds = work / f"zero3-{processes}.json"
        ds.write_text(
            json.dumps(
                {
                    "train_batch_size": processes,
                    "train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": 1,
                    # sized from the hidden size, as `distsetup deepspeed --hidden_size` writes them: a model
                    # bigger than memory's (the trainer keeps DeepSpeed's own where they fit beside the state)
                    "zero_optimization": {"stage": 3, **unset_sizes({"stage": 3}, a.n_embd)},
                }
            )
        )
        overrides += ["distributed.backend=deepspeed", f"distributed.deepspeed_config={ds}"]
    else:
        overrides += ["distributed.backend=fsdp"]
    train = ["src/train.py", "--config", REPO / "config" / "config.yaml", *overrides, "--no_resume"]
    launch(processes, train, preexec_fn=join_cgroup)
    return json.loads((out / "summary.json").read_text())


def within(a, group_peak: int | None) -> str:
    """What the table's note says of a memory limit, and the most its group held (the kernel's count)."""
    if a.memory_limit is None or group_peak is None:
        return ""
    return (
        f", every launch in a memory cgroup of {a.memory_limit:g} GiB (a container's limit, which the trainer reads; "
        f"the group held at most {group_peak / 2**30:.2f} GiB, page cache included)"
    )


COLOURS = {"fsdp": "#1f77b4", "zero3": "#d62728", "sharded": "#555555"}


def plot(figures: list[dict]) -> str:
    """An SVG line plot: each backend's per-rank peak (rank 0, and the others' largest) against W, beside the sharded
    state's line, in units of the whole fp32 model."""
    width, height, left, bottom, top, right = 620, 340, 60, 40, 20, 190
    worlds = sorted({f["processes"] for f in figures})
    peak = max(max(f["setup"] + f["training"]) for f in figures)
    ceiling = max(peak, 4.0) * 1.1

    def x(world: int) -> float:
        return left + (width - left - right) * worlds.index(world) / max(len(worlds) - 1, 1)

    def y(units: float) -> float:
        return height - bottom - (height - top - bottom) * units / ceiling

    def line(points: list[tuple[int, float]], colour: str, dashed: bool, label: str, row: int) -> str:
        path = " ".join(f"{x(w):.1f},{y(u):.1f}" for w, u in points)
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        key_y = top + 16 * row
        return (
            f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>'
            f'<line x1="{width - right + 10}" y1="{key_y}" x2="{width - right + 30}" y2="{key_y}" stroke="{colour}" '
            f'stroke-width="2"{dash}/><text x="{width - right + 34}" y="{key_y + 4}" font-size="11">{label}</text>'
        )

    parts, row = [], 0
    for backend in sorted({f["backend"] for f in figures}):
        runs = sorted((f for f in figures if f["backend"] == backend), key=lambda f: f["processes"])
        rank0 = [(f["processes"], max(f["setup"][0], f["training"][0])) for f in runs]
        others = [(f["processes"], max(f["setup"][1:] + f["training"][1:])) for f in runs if f["processes"] > 1]
        parts.append(line(rank0, COLOURS[backend], False, f"{backend}: rank 0", row))
        parts.append(line(others, COLOURS[backend], True, f"{backend}: others (max)", row + 1))
        row += 2
    parts.append(line([(w, 4 / w) for w in worlds], COLOURS["sharded"], True, "sharded state (16P/W)", row))
    axes = [
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
    ]
    axes += [
        f'<text x="{x(w):.1f}" y="{height - bottom + 16}" font-size="11" text-anchor="middle">{w}</text>'
        for w in worlds
    ]
    ticks = [ceiling * i / 4 for i in range(5)]
    axes += [f'<text x="{left - 6}" y="{y(t) + 4:.1f}" font-size="11" text-anchor="end">{t:.1f}</text>' for t in ticks]
    axes.append(
        f'<text x="{(left + width - right) / 2}" y="{height - 6}" font-size="12" text-anchor="middle">'
        "processes (W)</text>"
    )
    axes.append(
        f'<text x="14" y="{(top + height - bottom) / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {(top + height - bottom) / 2})">peak per rank (whole fp32 models)</text>'
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">'
        + "".join(axes + parts)
        + "</svg>\n"
    )


def bare_process_bytes(backend: str) -> int:
    code = BARE.format(LIBRARY[backend])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return int(out.stdout.split()[-1]) * 1024  # the last line: DeepSpeed's import prints a warning on stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # about 200M parameters in 24 blocks, as deep as GPT-2 medium: FSDP2 and ZeRO-3 gather a block or two at a time,
    # so the fewer the blocks the more of the model a rank holds at once (a third with 12, docs/benchmarks.md)
    parser.add_argument("--n_layer", type=int, default=24)
    parser.add_argument("--n_embd", type=int, default=832)
    parser.add_argument("--n_head", type=int, default=13)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--backends", nargs="+", default=["fsdp", "zero3"], choices=["fsdp", "zero3"])
    # the measure is 2 steps (AdamW's moments exist from the first); more show whether the heap grows from
    # step to step (FSDP2's did, until the trainer mapped its sharded gradients apart: docs/benchmarks.md)
    parser.add_argument("--steps", type=int, default=2)
    # the blocks' activations recomputed in backward: what the state and the gathers cost without most of them
    parser.add_argument("--activation_checkpointing", default="none", choices=["none", "full"])
    parser.add_argument("--plot", type=Path, help="the SVG plot (default: the docs' one, for a run without recompute)")
    # a container's limit: the trainer plans within it (a rank without room hands its heap's free pages back)
    parser.add_argument("--memory_limit", type=float, help="GiB: run each launch in a memory cgroup of this limit")
    a = parser.parse_args()
    if a.plot is None and a.activation_checkpointing == "none" and a.memory_limit is None and a.steps == 2:
        a.plot = REPO / "docs" / "img" / "scale_memory.svg"
    params = gpt_params(256, 64, a.n_layer, a.n_embd)
    unit, bare = 4 * params, {backend: bare_process_bytes(backend) for backend in a.backends}
    rows, figures = [], []
    limit, group_peak = (None if a.memory_limit is None else int(a.memory_limit * 2**30)), None
    limited = MemoryCgroup(limit) if limit else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="scale-memory-") as work, limited as group:
        for backend in a.backends:
            for processes in a.processes:
                peaks = run(backend, processes, a, Path(work), group and group.join)["host_peak_bytes"]
                setup = [(b - bare[backend]) / unit for b in peaks["setup"]]
                training = [(b - bare[backend]) / unit for b in peaks["training"]]
                others = max(setup[1:] + training[1:], default=None)
                rank0 = max(setup[0], training[0])
                met = rank0 <= GOAL_RANK0 and (others is None or others <= GOAL_OTHERS)
                figures.append({"backend": backend, "processes": processes, "setup": setup, "training": training})
                rows.append(
                    [
                        backend,
                        processes,
                        setup[0],
                        training[0],
                        "" if others is None else max(setup[1:]),
                        "" if others is None else max(training[1:]),
                        4 / processes,
                        "met" if met or processes < 8 else "NOT met",
                    ]
                )
        group_peak = group.peak_bytes() if group else None
    text = table(
        [
            "backend",
            "W",
            "rank 0 set-up",
            "rank 0 training",
            "others set-up (max)",
            "others training (max)",
            "sharded state",
            "goal at W=8",
        ],
        rows,
    )
    text += (
        f"\n\nGPT {a.n_layer} x {a.n_embd} ({params / 1e6:.0f}M parameters, 1 unit = {unit / 2**30:.2f} GiB in fp32), "
        f"fp32, micro-batch 1 x 64 positions, {a.steps} steps{RECOMPUTED[a.activation_checkpointing]}"
        f"{within(a, group_peak)}. Each figure: a rank's peak resident memory less a bare "
        f"process's ({', '.join(f'{b}: {v / 2**30:.2f}' for b, v in bare.items())} GiB), in units of the whole fp32 "
        "model; 'sharded state': 16 bytes a parameter "
        "/ W. Goal: at W=8, others <= 0.75, rank 0 <= 1.25."
    )
    title = "Peak host memory per rank at scale (FSDP2, ZeRO-3)"
    title += ", activations recomputed" if a.activation_checkpointing != "none" else ""
    title += f", {a.steps} steps" if a.steps != 2 else ""
    record(title + (f", in {a.memory_limit:g} GiB" if a.memory_limit else ""), text)
    if a.plot is not None:
        a.plot.write_text(plot(figures))
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()

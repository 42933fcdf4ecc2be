"""Rank 0's record of the run: metrics.jsonl always, TensorBoard scalars too when it is installed."""

import json
import time
from pathlib import Path


class MetricsLog:
    """Appends one JSON line per logged step; mirrors each value to output_dir/tensorboard when
    `torch.utils.tensorboard` imports (tensorboard installed). Other ranks get a log that writes nothing."""

    def __init__(self, out_dir: Path, enabled: bool):
        self.jsonl = open(out_dir / "metrics.jsonl", "a") if enabled else None
        self.tensorboard = tensorboard_writer(out_dir / "tensorboard") if enabled else None

    def write(self, step: int, **values: float) -> None:
        if self.jsonl is None:
            return
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(f"train/{key}", value, step)
            self.tensorboard.flush()

    def close(self) -> None:
        for sink in (self.jsonl, self.tensorboard):
            if sink is not None:
                sink.close()
        self.jsonl = self.tensorboard = None


def tensorboard_writer(folder: Path):
    """A SummaryWriter, or None where tensorboard is not installed (imported only here, only when asked)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder))


class StepTimer:
    """Seconds spent in training steps, the time spent writing checkpoints left out (what throughput divides by)."""

    def __init__(self):
        self.start, self.checkpoint_seconds = time.perf_counter(), 0.0

    def checkpointing(self):
        return _Pause(self)

    @property
    def train_seconds(self) -> float:
        return max(time.perf_counter() - self.start - self.checkpoint_seconds, 1e-9)


class _Pause:
    def __init__(self, timer: StepTimer):
        self.timer = timer

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.timer.checkpoint_seconds += time.perf_counter() - self.t0

"""Rank 0's record of the run: metrics.jsonl always, TensorBoard scalars too when it is installed."""

import contextlib
import json
import statistics
import time
from collections import deque
from pathlib import Path


class MetricsLog:
    """Appends one JSON line per logged step; mirrors each value to output_dir/tensorboard when
    `torch.utils.tensorboard` imports (tensorboard installed). Other ranks get a log that writes nothing."""

    def __init__(self, out_dir: Path, enabled: bool):
        self.jsonl = open(out_dir / "metrics.jsonl", "a") if enabled else None
        self.tensorboard = tensorboard_writer(out_dir / "tensorboard") if enabled else None

    def write(self, step: int, section: str = "train", **values: float) -> None:
        """One line of `values` at `step`; TensorBoard files them under `section` (train, eval)."""
        if self.jsonl is None:
            return
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(f"{section}/{key}", value, step)
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
    """Seconds spent in training steps, checkpoint writes and evaluations left out: in all (what throughput divides
    by) and for each of the latest steps (their median is the steady pace, without the first step's one-off
    costs)."""

    def __init__(self, window: int = 1000):
        self.train_seconds = self.checkpoint_seconds = self.eval_seconds = 0.0
        self.checkpoint_stalls: list[float] = []  # seconds the loop waited, per checkpoint (and the final wait)
        self.recent_steps: deque[float] = deque(maxlen=window)
        self._step_began, self._paused = time.perf_counter(), 0.0

    def step_done(self) -> None:
        now = time.perf_counter()
        seconds = now - self._step_began - self._paused
        self.train_seconds += seconds
        self.recent_steps.append(seconds)
        self._step_began, self._paused = now, 0.0

    @property
    def median_step_seconds(self) -> float | None:
        return statistics.median(self.recent_steps) if self.recent_steps else None

    @contextlib.contextmanager
    def checkpointing(self):
        with self._pause() as seconds:
            yield
        self.checkpoint_seconds += seconds[0]
        self.checkpoint_stalls.append(seconds[0])

    @contextlib.contextmanager
    def evaluating(self):
        with self._pause() as seconds:
            yield
        self.eval_seconds += seconds[0]

    @contextlib.contextmanager
    def _pause(self):
        """Time left out of the current step; yields a list that holds the seconds once the block is over."""
        began, seconds = time.perf_counter(), [0.0]
        try:
            yield seconds
        finally:
            seconds[0] = time.perf_counter() - began
            self._paused += seconds[0]

"""Rank 0's record of the run (metrics.jsonl always; TensorBoard and Weights & Biases as training.report_to says)
and the timer behind tokens/s."""

import contextlib
import dataclasses
import importlib.util
import json
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from distsetup.errors import DistsetupError, first_line
from distsetup.formats.runconfig import SECTIONS, RunConfig
from distsetup.training.run_record import METRICS, TENSORBOARD, continue_metrics

LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_RUN_ID = "wandb_run_id"  # in output_dir: a resumed run continues the same W&B run


def reporters(report_to: list[str] | None) -> list[str]:
    """The reporters a run writes to: `training.report_to`, or (unset) TensorBoard where it is installed. A
    reporter asked for by name whose library is missing is one line, before any process group."""
    if report_to is None:
        return ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    for name in report_to:
        if importlib.util.find_spec(LIBRARIES[name]) is None:
            raise DistsetupError(
                f"training.report_to names {name}, which is not installed.",
                f"pip install {LIBRARIES[name]}, or remove {name} from training.report_to.",
            )
    return list(report_to)


def wandb_settings(cfg: RunConfig, resumed: bool, steps: int) -> dict:
    """What a W&B run is started with: the run config's names and tags, the whole config (with the run's `steps`:
    training.max_steps, or its epochs' steps), and whether it continues the W&B run of the checkpoint it resumed
    (else a new one)."""
    t = cfg.training
    config = {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}
    config["training"]["max_steps"] = steps
    return {"project": t.wandb_project, "name": t.run_name, "tags": t.wandb_tags, "config": config, "resumed": resumed}


def as_json(value, **options) -> str:
    """`value` as JSON text that every JSON reader takes: NaN and infinities (no loss yet; a loss that diverged) as
    null, since JSON has no such numbers (json.dumps would write a bare NaN, which only Python's reader accepts)."""
    return json.dumps(finite(value), allow_nan=False, **options)


def finite(value):
    """`value` with each float that is NaN or infinite, in its dicts, lists and tuples too, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


class MetricsLog:
    """Rank 0's record of the run: one JSON line per logged step in metrics.jsonl, and the same values in
    TensorBoard (output_dir/tensorboard) and W&B (output_dir/wandb; offline with WANDB_MODE=offline) as
    `report_to` says. Other ranks get a log that writes nothing. The record goes on from `start_step`
    (run_record.py): `repeated_lines` says how many lines of later steps metrics.jsonl had."""

    def __init__(
        self,
        out_dir: Path,
        enabled: bool,
        report_to: Sequence[str] = (),
        wandb_settings: dict | None = None,
        start_step: int = 0,
    ):
        self.repeated_lines = continue_metrics(out_dir / METRICS, start_step) if enabled else 0
        self.jsonl = open(out_dir / METRICS, "a") if enabled else None
        self.tensorboard = (
            tensorboard_writer(out_dir / TENSORBOARD, purge_step=start_step + 1)
            if enabled and "tensorboard" in report_to
            else None
        )
        self.wandb = wandb_run(out_dir, wandb_settings or {}) if enabled and "wandb" in report_to else None

    def write(self, step: int, section: str = "train", /, **values: float | None) -> None:
        """One line of `values` at `step` (None: not known, left out; NaN or infinite, a loss that diverged: null
        there, as JSON has no such numbers); the reporters file them under `section` (train, eval)."""
        if self.jsonl is None:
            return
        known = {key: value for key, value in values.items() if value is not None}
        self.jsonl.write(as_json({"step": step, **known}) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in known.items():
                self.tensorboard.add_scalar(f"{section}/{key}", value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({f"{section}/{key}": value for key, value in known.items()}, step=step)

    def summarize(self, summary: dict) -> None:
        """The run's summary.json figures in W&B's run summary too."""
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float)})

    def close(self, exit_code: int = 0, preempted: bool = False) -> None:
        """`exit_code`: the trainer's exit status; a preempted run (non-zero) shows in W&B as preempted, not failed."""
        for sink in (self.jsonl, self.tensorboard):
            if sink is not None:
                sink.close()
        if self.wandb is not None:
            if preempted:
                self.wandb.mark_preempting()
            self.wandb.finish(exit_code=exit_code)
        self.jsonl = self.tensorboard = self.wandb = None


def tensorboard_writer(folder: Path, purge_step: int):
    """TensorBoard's writer into `folder`, whose events from `purge_step` on (a crashed run's) TensorBoard hides."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(folder), purge_step=purge_step)


def wandb_run(out_dir: Path, settings: dict):
    """The W&B run of output folder `out_dir`: when the run resumes a checkpoint there, the run that wrote it,
    continued (W&B keeps the steps it already has); else a new one, whose id is kept in out_dir."""
    import wandb

    id_file = out_dir / WANDB_RUN_ID
    resumed = settings.get("resumed") and id_file.exists()
    run_id = id_file.read_text().strip() if resumed else uuid.uuid4().hex[:12]
    try:
        run = wandb.init(
            project=settings.get("project"),
            name=settings.get("name"),
            tags=settings.get("tags") or None,
            config=settings.get("config"),
            dir=str(out_dir),
            id=run_id,
            resume="allow",
        )
    except wandb.errors.UsageError as e:  # no login, most often: W&B's own words, and the two ways on
        raise DistsetupError(
            f"training.report_to wandb: {first_line(e).rstrip('.')}.",
            "run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log locally.",
        ) from None
    id_file.write_text(run_id)
    return run


class StepTimer:
    """Seconds spent in training steps, checkpoint writes and evaluations left out: in all (what throughput divides
    by) and for each of the latest steps (their median is the steady pace, without the first step's one-off
    costs). `synchronize` waits for the device's queued work (world.synchronizer): called before every reading of
    the clock, it charges a GPU's work to the step that queued it, not to the checkpoint or evaluation after it."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None, window: int = 1000):
        self.synchronize = synchronize
        self.train_seconds = self.checkpoint_seconds = self.eval_seconds = 0.0
        self.checkpoint_stalls: list[float] = []  # seconds the loop waited, per checkpoint (and the final wait)
        self.recent_steps: deque[float] = deque(maxlen=window)
        self.first_step_done_at: float | None = None  # Unix time: how long a run takes to start, from outside
        synchronize()  # the set-up's work (a checkpoint's load) is no step's
        self._step_began, self._paused = time.perf_counter(), 0.0

    def step_done(self) -> None:
        self.synchronize()
        if self.first_step_done_at is None:
            self.first_step_done_at = time.time()
        now = time.perf_counter()
        seconds = now - self._step_began - self._paused
        self.train_seconds += seconds
        self.recent_steps.append(seconds)
        self._step_began, self._paused = now, 0.0

    @property
    def median_step_seconds(self) -> float | None:
        return statistics.median(self.recent_steps) if self.recent_steps else None

    def summary(self) -> dict:
        """Its part of summary.json."""
        return {
            "train_seconds": self.train_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "checkpoint_stalls": self.checkpoint_stalls,
            "eval_seconds": self.eval_seconds,
            "median_step_seconds": self.median_step_seconds,
            "step_seconds": list(self.recent_steps),  # of the latest steps, checkpoints and evaluations left out
            "first_step_done_at": self.first_step_done_at,
        }

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
        self.synchronize()  # the step's work, still queued, is the step's
        began, seconds = time.perf_counter(), [0.0]
        try:
            yield seconds
            self.synchronize()  # and the block's is the block's (a block that failed is not waited for)
        finally:
            seconds[0] = time.perf_counter() - began
            self._paused += seconds[0]

"""What the trainer's set-up makes for its loop (Trainer._set_up), each part typed, none of it there before."""

from dataclasses import dataclass, field

from distsetup.training.data.datasets import Datasets, ShardedSampler
from distsetup.training.data.loader import StepLoader
from distsetup.training.evaluations import Evaluations
from distsetup.training.loss.python_objective import PythonObjective
from distsetup.training.loss.token_objective import TokenObjective
from distsetup.training.metrics import MetricsLog, StepTimer
from distsetup.training.model.throughput import mfu
from distsetup.training.preemption import PREEMPTED
from distsetup.training.progress import Progress
from distsetup.training.world import StepAgreement


@dataclass
class Loop:
    """What set-up made for the loop (Trainer._set_up): the data and the order ranks read it in, the objective, the
    FLOPs and peak MFU is computed from, and the loader, metrics, progress, timer, per-step agreement and
    evaluations."""

    data: Datasets
    sampler: ShardedSampler
    objective: TokenObjective | PythonObjective
    flops: float | None  # training FLOPs per token or sample
    peak: float | None  # the device's peak TFLOP/s in the run's precision
    metrics: MetricsLog
    progress: Progress
    loader: StepLoader
    # the timer leaves checkpoints and evaluations out, and waits for the GPU's queued work wherever it reads time
    timer: StepTimer
    agreement: StepAgreement
    evaluations: Evaluations
    first_step: int
    # the step and training seconds of the last log line (throughput is since then); the first step's at first
    logged: tuple[int, float] = field(init=False)

    def __post_init__(self) -> None:
        self.logged = (self.first_step, 0.0)

    def figures(self, step: int, world_size: int, items_per_step: int) -> dict:
        """The loop's figures for summary.json at step `step`: its evaluations (the last one's figures: the loss, the
        perplexity or the user's terms, val_accuracy), its pace since set-up (items: tokens or samples), its MFU, and
        where its time went."""
        unit = self.objective.unit
        steps_per_s = per_s = None  # no pace where no step ran (a run resumed from its last step)
        if step > self.first_step:
            steps_per_s = (step - self.first_step) / max(self.timer.train_seconds, 1e-9)
            per_s = steps_per_s * items_per_step
        return {
            **self.evaluations.figures(),
            f"{unit}_per_s": per_s,
            "mfu": mfu(per_s, self.flops, world_size, self.peak) if self.flops and per_s is not None else None,
            "peak_tflops": self.peak,
            f"flops_per_{unit.removesuffix('s')}": self.flops,
            "steps_per_s": steps_per_s,
            **self.timer.summary(),
        }

    def close(self, status: int) -> None:
        try:
            self.loader.close()
            self.progress.close()
        finally:  # also when training raised: the last metrics line reaches the disk
            self.metrics.close(status, preempted=status == PREEMPTED)

"""The loop's evaluations: the steps one is due at, the one a stopped run left out (a stop during an evaluation
checkpoints its step without it, and the run that resumes there runs it first), and what those that ran found."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from distsetup.training.metrics import MetricsLog
from distsetup.training.progress import Progress
from distsetup.training.world import decided_by_rank0


@dataclass
class Evaluations:
    has_data: bool  # a validation set
    interval: int | None  # training.eval_interval; the last step evaluates too
    max_steps: int
    done_at: int | None = None  # the step of the latest evaluation every rank knows of: this run's, or its checkpoint's
    # rank 0's, one per evaluation ({"step", "val_loss", ...}): a resumed run's summary lists those before it too
    records: list[dict] = field(default_factory=list)

    def due_at(self, step: int) -> bool:
        return self.has_data and (step == self.max_steps or (self.interval is not None and step % self.interval == 0))

    def resumed_step_left_out(self, step: int) -> bool:
        """Whether the step a run resumes at lost its evaluation to a stop (the stopped run saved its work first);
        the last step's is last_step_left_out's."""
        return 0 < step < self.max_steps and self.due_at(step) and self.done_at != step

    def last_step_left_out(self, step: int, first_step: int, summary_file: Path) -> bool:
        """The last step's evaluation, where none ran after its checkpoint: a run stopped at its last step
        checkpoints first, and one resumed there (killed during that evaluation) runs it; not a finished run started
        again (its summary written: rank 0's answer, as every rank must agree)."""
        if not self.has_data or step != self.max_steps or self.done_at == step:
            return False
        return first_step < step or not decided_by_rank0(summary_file.is_file)

    def run(
        self, step: int, evaluate: Callable[[], dict[str, float] | None], metrics: MetricsLog, progress: Progress
    ) -> bool:
        """Whether the step's evaluation ran to its end (`evaluate` returns None where the ranks agreed to stop
        during it); its figures logged, and said on rank 0."""
        result = evaluate()
        if result is None:
            return False
        self.records.append({"step": step, **result})
        self.done_at = step
        metrics.write(step, "eval", **result)
        # the loss, then perplexity (tokens) or the user's terms: "..., accuracy 0.8125"
        others = "".join(
            f", {name.removeprefix('val_')} {value:.4g}" for name, value in result.items() if name != "val_loss"
        )
        progress.say(f"step {step}: validation loss {result['val_loss']:.4f}{others}")
        return True

    def val_loss_at(self, step: int) -> float | None:
        """The validation loss of the evaluation at `step`; None where none ran at it."""
        last = self.records[-1] if self.records else {}
        return last["val_loss"] if last.get("step") == step else None

    def figures(self) -> dict:
        """summary.json's: the last evaluation's figures (the loss, the perplexity or the user's terms), and every
        evaluation's."""
        last = self.records[-1] if self.records else {}
        return {
            "val_loss": last.get("val_loss"),
            "val_perplexity": last.get("val_perplexity"),
            **{name: value for name, value in last.items() if name.startswith("val_")},  # the loss's own terms too
            "evals": self.records,
        }

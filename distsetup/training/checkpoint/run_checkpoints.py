"""A run's checkpoints as its loop sees them: which are written (never one of weights gone wrong), which are trusted
(confirmed), which are withdrawn.

A checkpoint is trusted once the step after it, trained from its weights, has a loss that is a number: only then
may training.keep_checkpoints remove older ones for it. Where that loss is not a number, the weights it saved were
gone wrong: it is withdrawn (a run resumes from the one before it, which nothing removed) and the run stops. A
stopped run's checkpoint is confirmed by the first step of the run that resumes from it; the finished run's last one
by no step (it is the run's result). fp16's loss scale skips a step whose loss is not a number, leaving the weights
as they were: there such a loss confirms.
"""

import math
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import MARKER, Marker, step_dir
from distsetup.training.checkpoint.files import Checkpointing, PendingCheckpoint, amend_marker, start_checkpoint
from distsetup.training.launch_env import World


class RunCheckpoints:
    """The checkpoint still written in the background (`pending`, training.async_checkpoint) and the one the next
    step's loss confirms (`unconfirmed`); every rank calls each method at the same step."""

    def __init__(self, backend: Checkpointing, world: World, root: Path, keep: int | None, precision: str):
        self.backend, self.world, self.root, self.keep, self.precision = backend, world, root, keep, precision
        self.pending: PendingCheckpoint | None = None
        self.unconfirmed: PendingCheckpoint | None = None

    def resumed_from(self, path: Path, marker: Marker) -> None:
        """The run resumed from checkpoint `path`: a stopped run's, or one a crash left unchecked, is checked by
        this run's first step."""
        if marker.confirmed is False:
            self.unconfirmed = PendingCheckpoint(path, marker, [], self.keep, confirmed=False, finished=True)

    def writing(self) -> bool:
        """Whether this rank still writes a checkpoint in the background."""
        return self.pending is not None and not self.pending.written_here()

    def finish_pending(self) -> None:
        """Complete the checkpoint written in the background, if any (every rank's part is on disk, or it waits)."""
        if self.pending is not None:
            self.pending.finish(self.world, self.backend)
            self.pending = None

    def write(self, marker: Marker, background: bool, confirmed: bool) -> None:
        """Checkpoint `marker.step` (the one before it completed first), in the background or whole; `confirmed`:
        trusted as it is (the finished run's last), else once the next step confirms it. Refused where the step's
        loss says its weights are gone wrong."""
        self.finish_pending()
        self._refuse_weights_gone_wrong(marker.step, marker.loss)
        self.pending = start_checkpoint(self.backend, self.root, self.world, marker, self.keep, background, confirmed)
        if not confirmed:
            self.unconfirmed = self.pending
        if not background:
            self.finish_pending()

    def confirm_or_withdraw(self, step: int, loss: float) -> None:
        """Step `step`, the first after the unconfirmed checkpoint, trained from its weights to `loss` (agreed by
        every rank): confirmed where that is a number (the older ones may go for it); withdrawn, and the run
        stopped, where it is not."""
        checkpoint, self.unconfirmed = self.unconfirmed, None
        assert checkpoint is not None
        if self._loss_left_weights_whole(loss):
            checkpoint.confirm(self.world)
            return
        if self.pending is checkpoint:  # still written in the background: it never completes
            self.pending = None
        saved = checkpoint.marker.step
        checkpoint.withdraw(self.world, self.backend, f"step {step}, trained from its weights, has a loss of {loss}")
        raise DistsetupError(
            f"the loss is {loss} at step {step}, the first after the checkpoint of step {saved}, which is withdrawn "
            "(a run resumes from the one before it): its weights, or this step's batch, give no number.",
            "lower training.lr or raise training.warmup_steps, or look for a bad batch.",
            alike_on_every_rank=True,  # the loss every rank agreed on
        )

    def add_evaluation(self, step: int, val_loss: float | None) -> None:
        """The validation loss of step `step`, evaluated after its checkpoint (a stop left the evaluation out), into
        that checkpoint's marker, as an evaluation before it puts it there (`checkpoint ls`, its best): rank 0's, the
        others training on (a disk that refuses it is a note, not the run's end)."""
        folder = step_dir(self.root, step)
        if val_loss is None or not self.world.is_main or not (folder / MARKER).is_file():
            return
        try:
            amend_marker(folder, val_loss=val_loss)
        except OSError as e:
            print(f"note: the validation loss of step {step} is not in {folder}: {e.strerror or e}", flush=True)

    def _loss_left_weights_whole(self, loss: float) -> bool:
        """Whether a step's loss (agreed by every rank) is a number, or fp16's loss scale skipped a step whose loss
        is not one (its weights are those before it)."""
        return math.isfinite(loss) or self.precision == "fp16"

    def _refuse_weights_gone_wrong(self, step: int, loss: float | None) -> None:
        """A step whose loss is not a number has left weights that are none either, unless the fp16 loss scale
        skipped its update: such a checkpoint would become the one a run resumes from, and training.keep_checkpoints
        would remove the good ones for it."""
        if loss is None or self._loss_left_weights_whole(loss):
            return
        raise DistsetupError(
            f"the loss is {loss} at step {step}: the weights are no longer finite, so no checkpoint is written (the "
            "newest one stays the one a run resumes from).",
            "lower training.lr or raise training.warmup_steps, or look for a bad batch; a checkpoint whose bytes were "
            "damaged in place loads so too (move it aside).",
            alike_on_every_rank=True,  # the loss every rank agreed on
        )

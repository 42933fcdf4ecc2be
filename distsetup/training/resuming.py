"""Where a run resumes (--no_resume on its first start only), and the checkpoint loaded into it, with a note for
each setting of this run's that the checkpoint's overrides (its learning-rate schedule, its global batch's data
position)."""

import math
from collections.abc import Callable
from pathlib import Path

from distsetup.formats.checkpoint_folder import Marker, passed_over, resume_point
from distsetup.training import run_record
from distsetup.training.backends.base import Backend
from distsetup.training.checkpoint import files as ckpt
from distsetup.training.data.datasets import ShardedSampler
from distsetup.training.launch_env import World, restarted_by, run_identity
from distsetup.training.optim import follow_this_runs_schedule
from distsetup.training.world import decided_by_rank0


def afresh(no_resume: bool, out_dir: Path, say: Callable[[str], None]) -> bool:
    """Whether this start ignores the checkpoints (--no_resume). It is for the run's first start: a requeued SLURM
    job, or workers torchrun restarts, given the same command line, resume what the run wrote once its first start
    had set the previous record aside (each requeue started over). A first start stopped before that point, or
    another job that inherited a restart count, still starts afresh."""
    if not no_resume or not (restart := restarted_by()):
        return no_resume
    run = run_identity()
    if not decided_by_rank0(lambda: run_record.started_afresh_here(out_dir, run)):
        return True
    say(f"note: --no_resume is for the run's first start: {restart}, so it resumes where it stopped")
    return False


def resume_decision(
    root: Path, afresh: bool, backend: Backend, model_section: dict, say: Callable[[str], None]
) -> Path | None:
    """The checkpoint under `root` to resume (None: start afresh). Rank 0 alone reads the folders and every rank
    takes its answer: on a shared file system another node may see the newest marker late, and ranks resuming
    different steps would diverge. A checkpoint of another model is refused; one of another backend is adopted
    (converted) by this run's."""
    resume, damaged = decided_by_rank0(lambda: (None, []) if afresh else resume_point(root))
    if resume:
        marker = Marker.read(resume)
        ckpt.check_compatible(marker, resume, model_section)
        if conversion := backend.adopt(resume, marker):
            say(conversion)
    for problem in damaged:
        say(passed_over(problem))
    return resume


def load(
    resume: Path,
    backend: Backend,
    world: World,
    sampler: ShardedSampler,
    global_batch: int,
    steps: int,
    model_section: dict,
    say: Callable[[str], None],
) -> Marker:
    """Checkpoint `resume` loaded into the wrapped model and `sampler`, the lr following this run's schedule of
    `steps` steps; its marker. `model_section`: the run config's, said where it differs from the checkpoint's and the
    load fails."""
    marker = ckpt.load_checkpoint(backend, resume, world, model_section)
    say(f"resumed from {resume} (step {marker.step})")
    lrs = follow_this_runs_schedule(backend.scheduler)
    if lrs is not None and not math.isclose(*lrs, rel_tol=1e-6):  # this run is longer or shorter
        say(
            f"note: this run's schedule spans {steps} steps: lr {lrs[1]:.6g} at step {marker.step + 1} "
            f"({lrs[0]:.6g} in the checkpoint's run)"
        )
    kept = backend.scheduled_peak_lr()
    if kept is not None and not math.isclose(kept, backend.lr, rel_tol=1e-6):  # as the HF Trainer resumes
        say(
            f"note: the checkpoint's learning-rate schedule goes on, to peak lr {kept:.6g}; this run's "
            f"{backend.lr:.6g} is for a fresh start (--no_resume)"
        )
    position = marker.data_position  # None: a marker written by hand, or by a distsetup that stored none
    if position is None:
        say(f"note: checkpoint {resume.name} holds no data position: the data starts at its first sample")
        return marker
    sampler.load_state_dict(position)
    if marker.global_batch != global_batch:
        say(
            f"note: the checkpoint's global batch was {marker.global_batch}, this run's is {global_batch}: "
            f"continuing from sample {sampler.position} of epoch {sampler.epoch}"
        )
    return marker

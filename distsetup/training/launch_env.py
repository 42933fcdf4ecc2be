"""Who this process is (rank, local rank, world, node), as the launcher's environment says: no torch, so that a
rank can tell before importing it whether it is the one to say an error (distsetup/train.py)."""

import os
import signal
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """This process's place in the job, as the launcher (torchrun, deepspeed, srun) described it."""

    rank: int
    local_rank: int
    size: int
    local_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SRUN_NAMES = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


# Set in a process that its scheduler or launcher started again with the command line of the first start
RESTART_COUNTS = {"SLURM_RESTART_COUNT": "SLURM requeued the job", "TORCHELASTIC_RESTART_COUNT": "torchrun restarted"}


def restarted_by() -> str | None:
    """What started this process again with the first start's command line (a requeued SLURM job, torchrun's
    restart of its workers), as "SLURM requeued the job (SLURM_RESTART_COUNT=1)"; None on a first start."""
    for variable, by in RESTART_COUNTS.items():
        if (count := os.environ.get(variable, "").strip()) not in ("", "0"):
            return f"{by} ({variable}={count})"
    return None


def run_identity() -> str | None:
    """The run a restart keeps (a SLURM job's id, requeued or not; torchrun's run id across its restarts of the
    workers), as "SLURM job 42"; None where neither launched this process."""
    if job := os.environ.get("SLURM_JOB_ID", "").strip():
        return f"SLURM job {job}"
    if run := os.environ.get("TORCHELASTIC_RUN_ID", "").strip():
        return f"torchrun run {run}"
    return None


def read_world(srun_stands_in: bool = False) -> World:
    """The one place that reads RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (a plain run: 1 process; the
    deepspeed launcher sets LOCAL_SIZE instead, and without either every rank is taken to share one node). With
    `srun_stands_in` (preflight, which srun may start without torchrun), srun's own names stand in for those a
    launcher did not set; the trainer never reads them: inside an allocation they describe the job, not its ranks."""

    def number(name: str, default: int) -> int:
        value = os.environ.get(name) or (os.environ.get(SRUN_NAMES.get(name, "")) if srun_stands_in else None)
        return int(value) if value else default

    size = number("WORLD_SIZE", 1)
    return World(
        rank=number("RANK", 0),
        local_rank=number("LOCAL_RANK", 0),
        size=size,
        local_size=number("LOCAL_WORLD_SIZE", number("LOCAL_SIZE", size)),
    )


# prctl(2)'s option: the signal this process gets when the thread that started it (its launcher) dies
PR_SET_PDEATHSIG = 1
# The process that started this one, as it was when this module was first imported (the launcher, where one did)
PARENT_AT_START = os.getppid()
# What torchrun (and accelerate, which runs it) and the deepspeed launcher's launch.py set in the ranks they start
LAUNCHERS_OWN = ("TORCHELASTIC_RUN_ID", "LOCAL_SIZE")


def sigterm_when_the_launcher_dies() -> None:
    """A rank torchrun, accelerate or the deepspeed launcher started asks Linux for SIGTERM when that launcher dies:
    they start each rank in a session of its own, so a launcher killed outright (SIGKILL, the OOM killer) left its
    ranks training in a shell's or SLURM's allocation, holding the run's lock. SIGTERM is a preemption to them: they
    agree to stop, checkpoint and exit. Each of them starts its ranks from its main thread, whose end this signal
    follows. (In a pod or a SLURM step, the end of the launcher ends the container or the step, and the ranks with
    it.)"""
    if not any(name in os.environ for name in LAUNCHERS_OWN) or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (ImportError, OSError, AttributeError):  # no ctypes, no prctl: as before, the launcher's own care
        return
    if os.getppid() != PARENT_AT_START:  # the launcher died before the request: another process adopted this rank
        os.kill(os.getpid(), signal.SIGTERM)

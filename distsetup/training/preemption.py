"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning before the time limit) asks the run to checkpoint and stop, and
so does a first Ctrl-C while the run trains (SIGINT: torchrun passes it on to its ranks as it is; the deepspeed
launcher sends them SIGTERM)."""

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

PREEMPTED = 75  # EX_TEMPFAIL: "try again later", the status the sbatch script requeues on
INTERRUPTED = 130  # 128 + SIGINT: what a shell reports of a program Ctrl-C stopped; no requeue, no restart


class Preemption:
    """Remembers SIGTERM and SIGUSR1, and a first Ctrl-C while the loop runs (`ctrl_c_checkpoints`); the loop turns
    either into a checkpoint once the ranks have agreed to stop. A second Ctrl-C stops at once, without one
    (KeyboardInterrupt), and so does a Ctrl-C outside the loop (set-up: a tokenizer, a load). `announce`: this process
    says what a Ctrl-C does (rank 0; not the DataLoader workers it forks, which inherit the handler)."""

    def __init__(self, announce: bool):
        self.requested = self.by_ctrl_c = False
        self._announcer = os.getpid() if announce else None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    @contextlib.contextmanager
    def ctrl_c_checkpoints(self):
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    @property
    def status(self) -> int:
        """What the run exits with once it has checkpointed for the stop."""
        return INTERRUPTED if self.by_ctrl_c else PREEMPTED

    def stopped_at(self, step: int, say: Callable[[str], None]) -> int:
        """The run stopped at its checkpoint of `step`: said, the entry point told of a preemption; its status. A
        rank that no signal reached stops as preempted: its peers were."""
        if self.by_ctrl_c:
            say(f"stopped by Ctrl-C: checkpoint at step {step}")
        else:
            say(f"preempted: checkpoint at step {step}")
            tell_the_entry_point()
        return self.status

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            if self.requested:
                signal.default_int_handler(signum, frame)
            self.by_ctrl_c = True
            if os.getpid() == self._announcer:  # os.write: a print here could interrupt a print (reentrant)
                os.write(2, b"\nCtrl-C: checkpointing, then stopping (Ctrl-C again stops at once, without one)\n")
        self.requested = True


def tell_the_entry_point() -> None:
    """Where the script that started the run asks (DISTSETUP_PREEMPTED_FILE, set by the pod entry point `distsetup
    job` writes and by the requeuing SLURM script), a file saying that this rank stopped for preemption with its
    checkpoint whole: torchrun exits 1 whatever its ranks' status, and the script then exits with the status its
    engine restarts the job on, or requeues the SLURM job."""
    path = os.environ.get("DISTSETUP_PREEMPTED_FILE")
    if path:
        Path(path).touch()

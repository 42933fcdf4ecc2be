"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning before the time limit) asks the run to checkpoint and stop, and
so does a first Ctrl-C (SIGINT: the deepspeed launcher turns it into SIGTERM, torchrun passes it on as it is)."""

import os
import signal
from pathlib import Path

PREEMPTED = 75  # EX_TEMPFAIL: "try again later", the status the sbatch script requeues on


class Preemption:
    """Remembers SIGTERM, SIGUSR1 and a first Ctrl-C; the loop turns it into a checkpoint once the ranks have agreed
    to stop. A second Ctrl-C stops at once, without one (KeyboardInterrupt)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            if self.requested:
                signal.default_int_handler(signum, frame)
            if os.environ.get("RANK", "0") == "0":  # os.write: a print here could interrupt a print (reentrant)
                os.write(2, b"\nCtrl-C: checkpointing, then stopping (Ctrl-C again stops at once, without one)\n")
        self.requested = True


def tell_the_entry_point() -> None:
    """Where the node's entry point asks (DISTSETUP_PREEMPTED_FILE, set by the pod entry point `distsetup job`
    writes), a file saying that this rank stopped for preemption with its checkpoint whole: torchrun exits 1 whatever
    its ranks' status, and the entry point then exits with the status its engine restarts the job on."""
    path = os.environ.get("DISTSETUP_PREEMPTED_FILE")
    if path:
        Path(path).touch()

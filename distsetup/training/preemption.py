"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning before the time limit) asks the run to checkpoint and stop."""

import signal

PREEMPTED = 75  # EX_TEMPFAIL: "try again later", the status the sbatch script requeues on


class Preemption:
    """Remembers SIGTERM/SIGUSR1; the loop turns it into a checkpoint once the ranks have agreed to stop."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

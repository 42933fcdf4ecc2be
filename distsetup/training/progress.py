"""Rank 0's progress: a bar where the output is a terminal, a plain line per logged step where it is not.

A job's log (SLURM's output file, a pod's log, nohup's file) is no terminal: there a bar redraws itself with carriage
returns, which pile up into one line megabytes long over a run. So there rank 0 prints one line at each logged step
(`training.log_interval`), as torchtitan and the HF Trainer's logging do.
"""

import sys
from typing import TextIO

from tqdm import tqdm


class Progress:
    """The run's steps out of `total`, from `initial` (a resumed run's step); nothing where `shown` is false (every
    rank but 0)."""

    def __init__(self, total: int, initial: int, shown: bool, terminal: TextIO | None = None) -> None:
        self.total, self.shown = total, shown
        terminal = terminal or sys.stderr
        self.bar = None
        if shown and terminal.isatty():
            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, file=terminal)

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def logged(
        self,
        step: int,
        loss: float,
        lr: float,
        per_s: float,
        unit: str,
        mfu: float | None = None,
        loss_scale: float | None = None,
    ) -> None:
        """The figures of a logged step (`mfu`: where it is known; `loss_scale`: fp16's, which falls where steps
        overflow and are skipped): on the bar, or as a line of their own."""
        scale = {} if loss_scale is None else {"loss_scale": f"{loss_scale:g}"}
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", **scale)
        else:
            utilisation = f", MFU {mfu:.1%}" if mfu is not None else ""
            scaled = f", loss scale {loss_scale:g}" if loss_scale is not None else ""
            figures = f"loss {loss:.4f}, lr {lr:.2e}, {per_s:.3g} {unit}/s{utilisation}{scaled}"
            self.say(f"step {step}/{self.total}: {figures}")

    def say(self, line: str) -> None:
        """A line of its own (an evaluation's result), above the bar where there is one."""
        if self.bar is not None:
            self.bar.write(line)
        elif self.shown:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

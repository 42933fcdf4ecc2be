"""summary.json's training peak leaves every checkpoint's own peak out, also the last one, and a background one that
finishes after the last step (its staged copy is still resident when the count starts again). Driven through the
trainer's own accounting, with the process's high-water mark (Linux's VmHWM) played by a counter."""

import pytest

from distsetup.training import memory
from distsetup.training.trainer import Trainer


class HighWaterMark:
    """VmHWM: the most resident since the last reset, which starts it again from what is resident now."""

    def __init__(self):
        self.resident = self.peak = 100

    def hold(self, resident: int) -> None:
        self.resident = resident
        self.peak = max(self.peak, resident)

    def reset(self) -> None:
        self.peak = self.resident


@pytest.fixture
def hwm(monkeypatch):
    mark = HighWaterMark()
    monkeypatch.setattr(memory, "host_peak_bytes", lambda: mark.peak)
    monkeypatch.setattr(memory, "reset_host_peak", mark.reset)
    return mark


def accounting() -> Trainer:
    trainer = Trainer.__new__(Trainer)  # the accounting alone: no run config, no process group
    trainer.step, trainer.train_peak, trainer.peak_counted_after_step = 0, 0, -1
    return trainer


def test_a_background_checkpoint_finishing_after_the_last_step_is_left_out(hwm):
    trainer = accounting()
    for step in (1, 2):
        trainer.step = step
        hwm.hold(200)  # a step's peak
        hwm.hold(150)
    with trainer._left_out_of_the_training_peak():  # the last checkpoint, started in the background
        hwm.hold(620)  # staging its copy
        hwm.hold(600)  # the staged copy, resident until written
    with trainer._left_out_of_the_training_peak():  # its writer finishes after the loop
        hwm.hold(650)
        hwm.hold(150)
    trainer._note_training_peak()  # what _host_peaks reports
    assert trainer.train_peak == 200


def test_steps_after_a_checkpoint_count_and_the_checkpoint_does_not(hwm):
    trainer = accounting()
    trainer.step = 1
    hwm.hold(200)
    with trainer._left_out_of_the_training_peak():
        hwm.hold(900)
        hwm.hold(150)
    trainer.step = 2
    hwm.hold(300)  # the next step peaks higher than the first
    trainer._note_training_peak()
    assert trainer.train_peak == 300

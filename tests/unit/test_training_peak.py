"""summary.json's training peak leaves every checkpoint's own peak out, also the last one, and a background one that
finishes after the last step (its staged copy is still resident when the count starts again). Driven through the
trainer's accounting (memory.TrainingPeak, as Trainer calls it), with the process's high-water mark (Linux's VmHWM)
played by a counter."""

import pytest

from distsetup.training import memory


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


def test_a_background_checkpoint_finishing_after_the_last_step_is_left_out(hwm):
    peak = memory.TrainingPeak()
    for _ in (1, 2):  # two steps
        hwm.hold(200)  # a step's peak
        hwm.hold(150)
    with peak.left_out(2):  # the last checkpoint, started in the background
        hwm.hold(620)  # staging its copy
        hwm.hold(600)  # the staged copy, resident until written
    with peak.left_out(2):  # its writer finishes after the loop
        hwm.hold(650)
        hwm.hold(150)
    peak.note(2)  # what the summary reports
    assert peak.bytes == 200


def test_steps_after_a_checkpoint_count_and_the_checkpoint_does_not(hwm):
    peak = memory.TrainingPeak()
    hwm.hold(200)  # step 1
    with peak.left_out(1):
        hwm.hold(900)
        hwm.hold(150)
    hwm.hold(300)  # step 2 peaks higher than the first
    peak.note(2)
    assert peak.bytes == 300

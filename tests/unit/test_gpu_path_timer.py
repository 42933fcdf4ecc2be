"""The step timer waits for the device before it reads the clock: a GPU runs the work a step queued after the host
has moved on, and without the wait that work would be charged to the checkpoint or evaluation after it (or to no
step at all), making step times, tokens/s and MFU wrong."""

import functools
import time

import pytest
import torch

from distsetup.training.metrics import StepTimer
from distsetup.training.world import synchronizer

QUEUED = 0.05  # seconds of work the device still has to do whenever the timer waits for it


def test_each_reading_of_the_clock_waits_for_the_device_first():
    waits = []

    def synchronize():  # a device with QUEUED seconds of work left whenever it is waited for
        waits.append(time.perf_counter())
        time.sleep(QUEUED)

    timer = StepTimer(synchronize)
    assert len(waits) == 1  # the set-up's work: no step's
    timer.step_done()
    with timer.checkpointing():
        pass
    with timer.evaluating():
        pass
    timer.step_done()
    assert len(waits) == 7  # at each step's end, and at the start and end of each pause
    first, second = timer.recent_steps
    assert first >= QUEUED
    assert second >= 3 * QUEUED  # what the step queued before the checkpoint and the evaluation, and at its end
    assert timer.checkpoint_seconds >= QUEUED and timer.eval_seconds >= QUEUED  # what each queued itself


def test_a_failed_pause_is_not_waited_for():
    waits = []
    timer = StepTimer(lambda: waits.append(1))
    with pytest.raises(RuntimeError), timer.checkpointing():
        raise RuntimeError("a peer is gone")
    assert len(waits) == 2  # the set-up's and the step's, not the failed block's


def test_a_gpu_timer_synchronizes_its_device_and_a_cpu_timer_nothing():
    gpu = synchronizer(torch.device("cuda", 1))
    assert isinstance(gpu, functools.partial) and gpu.func is torch.cuda.synchronize
    assert gpu.args == (torch.device("cuda", 1),)
    assert synchronizer(torch.device("cpu"))() is None

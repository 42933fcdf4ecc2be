"""Rank 0's metrics (JSONL, TensorBoard when installed) and the timer behind tokens_per_s."""

import importlib.util
import json
import sys
import time
import types

import pytest
import torch

from distsetup.training.metrics import MetricsLog, StepTimer
from distsetup.training.world import StepAgreement


def test_jsonl_always_and_no_tensorboard_folder_without_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    log = MetricsLog(tmp_path, enabled=True)
    log.write(1, loss=2.5, lr=1e-3)
    log.write(2, loss=2.0, lr=2e-3)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "loss": 2.0, "lr": 2e-3}]
    assert not (tmp_path / "tensorboard").exists()


def test_scalars_go_to_tensorboard_when_it_imports(tmp_path, monkeypatch):
    calls = []

    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("closed",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    log = MetricsLog(tmp_path, enabled=True)
    log.write(3, loss=1.5, lr=4e-4)
    log.close()
    assert calls == [("dir", str(tmp_path / "tensorboard")), ("train/loss", 1.5, 3), ("train/lr", 4e-4, 3), ("closed",)]


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLog(tmp_path, enabled=False)
    log.write(1, loss=1.0)
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_real_tensorboard_writes_event_files(tmp_path):
    log = MetricsLog(tmp_path, enabled=True)
    log.write(1, loss=1.0)
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_timer_leaves_checkpoint_time_out():
    begin = time.perf_counter()
    timer = StepTimer(window=2)
    for seconds in (0.05, 0.02, 0.03):  # the first step also writes a checkpoint
        time.sleep(seconds)
        timer.step_done()
        if seconds == 0.05:
            with timer.checkpointing():
                time.sleep(0.2)
    wall = time.perf_counter() - begin
    assert timer.checkpoint_seconds >= 0.2
    assert timer.train_seconds + timer.checkpoint_seconds == pytest.approx(wall, abs=0.02)
    second, third = timer.recent_steps  # the window keeps the latest two
    assert 0.02 <= second < 0.2 and 0.03 <= third < 0.2  # the checkpoint's 0.2 s is in neither
    assert timer.median_step_seconds == (second + third) / 2


def test_ranks_settle_often_enough_for_a_signal_but_not_every_short_step():
    agreement = StepAgreement(world_size=1, device=torch.device("cpu"), every_seconds=1.0)
    assert agreement.due(1)
    settled = agreement.settle(1, [torch.tensor(2.0), torch.tensor(4.0, dtype=torch.bfloat16)], False, 0.05, False)
    assert settled == (3.0, False, True)
    assert not agreement.due(20) and agreement.due(21)  # 1 s of 50 ms steps
    assert agreement.settle(21, [torch.tensor(1.0)], True, 3.0, True) == (1.0, True, False)  # a write goes on
    assert agreement.due(22)  # steps longer than the period: every step

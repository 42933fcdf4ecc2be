"""Faults: kill -9 one rank mid-run or preempt with a signal, start again, end with the same weights."""

import os
import re
import signal

import pytest
import torch

from train_runs import (INTERVAL, STEPS, final_weights, losses, shared_run, start, train, wait_for, worker_pids,
                        write_run_config)


def assert_same_weights(resumed: dict, uninterrupted: dict):
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), f"{key} differs after resume"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp_full", "zero3"])
def test_kill_one_rank_then_resume_gives_the_uninterrupted_weights(tmp_path, name):
    config = write_run_config(tmp_path, name)
    out = tmp_path / "out"
    run = start(config, 2)
    wait_for(out / "checkpoints" / f"step_{INTERVAL:07d}" / "COMPLETE", run)
    os.kill(worker_pids(run.pid)[-1], signal.SIGKILL)
    run.wait(timeout=180)
    assert run.returncode != 0 and not (out / "summary.json").exists(), "the run finished before the kill"

    resumed = train(config, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resumed from \S+step_\d+ \(step (\d+)\)", resumed.stdout)
    assert len(losses(out)) == STEPS
    assert_same_weights(final_weights(out), final_weights(shared_run(name)))


@pytest.mark.slow
def test_sigterm_to_one_rank_checkpoints_exits_75_and_resumes(tmp_path):
    config = write_run_config(tmp_path, "ddp")
    out = tmp_path / "out"
    run = start(config, 2)
    wait_for(out / "checkpoints" / f"step_{INTERVAL:07d}" / "COMPLETE", run)
    os.kill(worker_pids(run.pid)[-1], signal.SIGTERM)
    run.wait(timeout=180)
    log = run.log.read_text()
    stopped = re.search(r"preempted: checkpoint at step (\d+)", log)
    assert stopped, log[-3000:]
    step = int(stopped.group(1))
    assert INTERVAL <= step < STEPS and (out / "checkpoints" / f"step_{step:07d}" / "COMPLETE").exists()
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", log)
    # torchrun SIGTERMs the peers once the first rank has exited (75), so a peer may read -15 there.
    assert "75" in codes and set(codes) <= {"75", "-15"}, codes

    resumed = train(config, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {step})" in resumed.stdout
    assert_same_weights(final_weights(out), final_weights(shared_run("ddp")))


@pytest.mark.slow
def test_sigusr1_single_process_exits_75(tmp_path):
    config = write_run_config(tmp_path, "single", checkpoint_interval=5)
    run = start(config, 1)
    wait_for(tmp_path / "out" / "checkpoints" / "step_0000005" / "COMPLETE", run)
    run.send_signal(signal.SIGUSR1)
    assert run.wait(timeout=120) == 75
    assert "preempted: checkpoint at step" in run.log.read_text()

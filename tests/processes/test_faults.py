"""Faults at random moments: kill -9 one random rank of a 2-process run, a few times, often mid-checkpoint;
each start resumes from the newest complete checkpoint, and the last one ends with the uninterrupted
run's weights and losses, bit for bit (fp32 on the CPU). DDP and FSDP write their checkpoints in the background
(training.async_checkpoint), so a mid-save kill lands while a background write is under way: the checkpoint
before it must stay the newest complete one.

The choices (which rank, at which step, mid-save or between saves, how long after) come from
`random.Random(f"{SEED}:{name}")`. SEED is fixed, so CI replays one campaign (the machine's timing still
varies a little); `FAULT_SEED=<seed> pytest tests/processes/test_faults.py` draws another, and every failure message
names the seed it used.
"""

import os
import random
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from train_runs import STEPS, final_weights, losses, shared_run, start, worker_pids, write_run_config

SEED = int(os.environ.get("FAULT_SEED") or 710025)
FAULT_INTERVAL = 2  # a checkpoint every other step, so a save is under way at many moments
# Kill k waits for a step in WINDOWS[k]. The windows are disjoint and end on a checkpoint step, so a folder
# a kill leaves behind never satisfies a later kill's wait; they end by step 24 so that a save missed by
# the poll still leaves later saves (and the run) to kill in.
WINDOWS = ((1, 12), (13, 24))
RUN_DEADLINE = 150  # seconds for one run, start to end; a run past it is hung


@dataclass
class Kill:
    rank: int
    step: int  # the first checkpoint at or after this step is the moment's anchor
    mid_save: bool  # kill while that checkpoint is being written (delay 0), or...
    delay: float  # ...this many seconds after it is complete


def plan(rng: random.Random) -> list[Kill]:
    """One kill per window; at least one of them mid-save."""
    mid = [True] + [rng.random() < 0.5 for _ in WINDOWS[1:]]
    rng.shuffle(mid)
    return [
        Kill(
            rank=rng.randrange(2),
            step=rng.randint(lo, hi),
            mid_save=m,
            delay=0.0 if m else round(rng.uniform(0, 0.05), 3),
        )
        for (lo, hi), m in zip(WINDOWS, mid, strict=True)
    ]


def step_of(folder: Path) -> int:
    return int(folder.name.split("_")[1])


def complete(folder: Path) -> bool:
    return (folder / "COMPLETE").is_file()


def newest_complete(root: Path) -> Path | None:
    done = [d for d in root.glob("step_*") if complete(d)] if root.is_dir() else []
    return max(done, key=step_of, default=None)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (this test's config path)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def end(run: subprocess.Popen, workers: list[int], why: str) -> None:
    """Stop a run this test started (torchrun and its workers, by pid) and fail."""
    for pid in [run.pid, *workers]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    run.wait(timeout=30)
    raise AssertionError(f"{why}\n{run.log.read_text()[-3000:]}")


def kill_at(run: subprocess.Popen, root: Path, kill: Kill, resumed_step: int, context: str) -> tuple[list[int], Path]:
    """Wait for the planned moment, SIGKILL the planned rank; returns (the worker pids, the anchoring checkpoint)."""
    deadline, workers, anchor, since = time.time() + RUN_DEADLINE, [], None, 0.0
    first_step = max(kill.step, resumed_step + 1)
    while True:
        if run.poll() is not None:
            raise AssertionError(
                f"{context}: the run ended (status {run.returncode}) before the kill {kill}:\n"
                f"{run.log.read_text()[-3000:]}"
            )
        if time.time() > deadline:
            end(run, workers or worker_pids(run.pid), f"{context}: no moment for {kill} within {RUN_DEADLINE}s")
        if len(workers) < 2:
            workers = worker_pids(run.pid)
        elif anchor is None and root.is_dir():
            # only folders this run writes (newer than the checkpoint it resumed from, in the kill's window):
            # one being written for a mid-save kill, a complete one otherwise
            fresh = [d for d in root.glob("step_*") if step_of(d) >= first_step]
            anchor = min((d for d in fresh if complete(d) != kill.mid_save), key=step_of, default=None)
            since = time.time()
        if anchor is not None and time.time() >= since + kill.delay:
            if kill.mid_save:  # freeze both ranks, so the save cannot finish between this look and the kill
                for pid in workers:
                    os.kill(pid, signal.SIGSTOP)
                if complete(anchor):  # it finished before they stopped: take the next save
                    for pid in workers:
                        os.kill(pid, signal.SIGCONT)
                    first_step, anchor = step_of(anchor) + 1, None
                    continue
            killed = workers[kill.rank]
            os.kill(killed, signal.SIGKILL)
            for pid in workers:
                if pid != killed:
                    os.kill(pid, signal.SIGCONT)  # torchrun ends it once it sees the kill
            return workers, anchor
        time.sleep(0.002)


def check_resume(log: str, expected: Path | None, context: str) -> int:
    """The run resumed from `expected` (the newest complete checkpoint when it started), or started afresh."""
    found = re.findall(r"resumed from (\S+) \(step (\d+)\)", log)
    if expected is None:
        assert not found, f"{context}: no complete checkpoint existed, yet the run says {found}"
        return 0
    assert found, f"{context}: expected a resume from {expected}; log:\n{log[-3000:]}"
    ((path, step),) = found
    passed_over = [line for line in log.splitlines() if "passed over" in line]
    assert Path(path) == expected and int(step) == step_of(expected), (
        f"{context}: resumed from {path} (step {step}), expected the newest complete one {expected}; {passed_over}"
    )
    assert complete(Path(path)), f"{context}: resumed from {path}, which has no COMPLETE marker"
    return int(step)


def assert_no_leftovers(config: Path, pids: list[int], context: str) -> None:
    left = sorted({p for p in pids if alive(p)} | set(processes_naming(str(config))))
    assert not left, f"{context}: processes left after the run ended: {left}"


def launch(config: Path, root: Path, kill: Kill | None, resume_from: Path | None, context: str):
    """Start a 2-process run, kill as planned (None: let it finish), wait for its end; (run, killed pid, anchor)."""
    run = start(config, 2)
    resumed_step = step_of(resume_from) if resume_from else 0
    workers, anchor = kill_at(run, root, kill, resumed_step, context) if kill else ([], None)
    try:
        run.wait(timeout=RUN_DEADLINE)
    except subprocess.TimeoutExpired:
        end(run, workers or worker_pids(run.pid), f"{context}: the run did not end within {RUN_DEADLINE}s (hung)")
    assert_no_leftovers(config, workers, context)
    return run, workers[kill.rank] if kill else None, anchor


def faulted_run(name: str, config: Path, kills: list[Kill], replay: str) -> None:
    """Start, kill as planned, start again ... until a start runs to the end; check where each one resumed."""
    out, root = config.parent / "out", config.parent / "out" / "checkpoints"
    skipped_incomplete = 0  # resumes that passed over a folder a kill left without its COMPLETE marker
    for n, kill in enumerate([*kills, None], start=1):
        context = f"{name}, start {n} of {len(kills) + 1}, {replay}"
        expected = newest_complete(root)
        incomplete = [d for d in root.glob("step_*") if not complete(d)] if root.is_dir() else []
        run, killed, anchor = launch(config, root, kill, expected, context)
        log = run.log.read_text()
        if kill is None:
            assert run.returncode == 0, f"{context}: the last run failed:\n{log[-3000:]}"
        else:
            state = "complete" if complete(anchor) else "incomplete"
            context += f", killed pid {killed} at {anchor.name} (left {state})"
            assert run.returncode != 0 and not (out / "summary.json").exists(), (
                f"{context}: the run finished despite the kill:\n{log[-3000:]}"
            )
            assert re.search(rf"exitcode\s*:\s*-9 \(pid: {killed}\)", log), (
                f"{context}: torchrun does not report pid {killed} killed by signal 9:\n{log[-3000:]}"
            )
        resumed = check_resume(log, expected, context)
        skipped_incomplete += any(step_of(d) > resumed for d in incomplete)
        print(
            f"start {n}: resumed from step {resumed}"
            + (f", killed rank {kill.rank} at {anchor.name} (left {state})" if kill else ", finished")
        )

    assert skipped_incomplete, f"{name}: no resume passed over a checkpoint a kill left incomplete; {replay}"


ASYNC = ("ddp", "fsdp_full")  # checkpoint with training.async_checkpoint: kills land mid background write


# ZeRO 1-2 save through the same engine.save_checkpoint as ZeRO-3; leaving them out keeps the suite in budget.
@pytest.mark.parametrize("name", ["ddp", "fsdp_full", "zero3"])
def test_kill_a_random_rank_at_random_moments_then_resume_gives_the_uninterrupted_run(tmp_path, name):
    kills = plan(random.Random(f"{SEED}:{name}"))
    replay = f"seed {SEED}, plan {kills} (replay: FAULT_SEED={SEED} pytest tests/processes/test_faults.py -k {name})"
    print(replay)
    config = write_run_config(tmp_path, name, checkpoint_interval=FAULT_INTERVAL, async_checkpoint=name in ASYNC)
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run (once per session) overlaps the faults
        reference = pool.submit(shared_run, name)
        faulted_run(name, config, kills, replay)
        reference = reference.result()
    out = tmp_path / "out"
    resumed_weights, uninterrupted = final_weights(out), final_weights(reference)
    assert resumed_weights.keys() == uninterrupted.keys(), replay
    for key in uninterrupted:
        assert torch.equal(resumed_weights[key], uninterrupted[key]), f"{name}: {key} differs after resume; {replay}"
    assert losses(out) == losses(reference), f"{name}: the losses differ from the uninterrupted run's; {replay}"
    assert len(losses(out)) == STEPS, replay

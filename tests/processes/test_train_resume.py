"""Faults: preempt one rank with a signal, damage a checkpoint, stop or starve a rank; start again, end with the same
weights (kill -9 at random moments, resumed to the same weights: test_faults.py)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from process_tree import process_tree
from train_runs import (
    INTERVAL,
    REPO,
    STEPS,
    TRAINING,
    command,
    copied_run,
    environment,
    final_weights,
    losses,
    shared_run,
    start,
    train,
    wait_for,
    worker_pids,
    write_run_config,
)


def assert_same_weights(resumed: dict, uninterrupted: dict):
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), f"{key} differs after resume"


@pytest.mark.parametrize("name, signalled", [("ddp", "torchrun"), ("zero2", "one rank")])
def test_sigterm_checkpoints_exits_75_and_resumes(tmp_path, name, signalled):
    """SIGTERM to one rank, or to torchrun, which passes it on to each rank's whole process group: the rank, its
    DataLoader workers (data.num_workers) and their fork server, which must serve the rank until it has checkpointed."""
    config = write_run_config(tmp_path, name)
    out = tmp_path / "out"
    run = start(config, 2, *(["data.num_workers=2"] if signalled == "torchrun" else []))
    wait_for(out / "checkpoints" / f"step_{INTERVAL:07d}" / "COMPLETE", run)
    os.kill(run.pid if signalled == "torchrun" else worker_pids(run.pid)[-1], signal.SIGTERM)
    run.wait(timeout=180)
    log = run.log.read_text()
    stopped = re.search(r"preempted: checkpoint at step (\d+)", log)
    assert stopped and "DataLoader worker" not in log, log[-3000:]
    step = int(stopped.group(1))
    assert INTERVAL <= step < STEPS and (out / "checkpoints" / f"step_{step:07d}" / "COMPLETE").exists()
    if signalled == "one rank":
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", log)
        # torchrun SIGTERMs the peers once the first rank has exited (75): each must still exit 75 itself.
        assert codes and set(codes) == {"75"}, codes

    resumed = train(config, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {step})" in resumed.stdout
    assert_same_weights(final_weights(out), final_weights(shared_run(name)))


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGINT"])
def test_a_signal_to_a_single_process_checkpoints_the_step_it_reached_and_exits(tmp_path, name):
    """SLURM's warning (SIGUSR1) and a first Ctrl-C (SIGINT; a second stops at once: test_preemption.py), sent to
    the process and all it started, as SLURM signals every process of a step and a terminal its foreground group:
    its DataLoader workers (data.num_workers), their fork server and multiprocessing's resource tracker."""
    config = write_run_config(tmp_path, "single", checkpoint_interval=5, max_steps=10_000)
    run = start(config, 1, "data.num_workers=2")
    wait_for(tmp_path / "out" / "checkpoints" / "step_0000005" / "COMPLETE", run)
    tree = process_tree(run.pid)
    assert len(tree) >= 5, tree  # the process, the tracker, the server and 2 workers
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
            os.kill(pid, getattr(signal, name))
    status, log = run.wait(timeout=120), run.log.read_text()
    said = "stopped by Ctrl-C" if name == "SIGINT" else "preempted"
    stopped = re.search(rf"{said}: checkpoint at step (\d+)", log)
    assert status == (130 if name == "SIGINT" else 75) and stopped, log[-3000:]  # Ctrl-C: no requeue, no restart
    assert "DataLoader worker" not in log and "leaked" not in log, log[-3000:]
    newest = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())[-1]
    assert newest == f"step_{int(stopped.group(1)):07d}" and int(stopped.group(1)) > 5
    assert ("Ctrl-C: checkpointing, then stopping" in log) == (name == "SIGINT")


def _damage_truncate(folder):
    state = folder / "state.pt"
    state.write_bytes(state.read_bytes()[:100])


DAMAGE = {
    "truncated state.pt": _damage_truncate,
    "garbage in COMPLETE": lambda folder: (folder / "COMPLETE").write_text("\x00garbage"),
    "{} in COMPLETE": lambda folder: (folder / "COMPLETE").write_text("{}"),
    "missing file": lambda folder: (folder / "rng_rank0.pt").unlink(),
    "junk in rng_rank0.pt": lambda folder: (folder / "rng_rank0.pt").write_bytes(b"junk"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage):
    out = tmp_path / "out"
    config = copied_run("single", tmp_path)  # checkpoints at steps 10, 20 and 30
    DAMAGE[damage](out / "checkpoints" / f"step_{STEPS:07d}")
    (out / "checkpoints" / "step_backup").mkdir()  # a folder a user made by hand: not a checkpoint
    (out / "checkpoints" / "step_backup" / "COMPLETE").write_text("{}")
    result = train(config, 1, f"training.max_steps={STEPS + 2}")
    assert result.returncode == 0, result.stderr[-3000:]
    passed_over = [line for line in result.stdout.splitlines() if line.startswith("passed over damaged checkpoint")]
    assert len(passed_over) == 1 and f"step_{STEPS:07d}" in passed_over[0], result.stdout[-2000:]
    assert f"(step {STEPS - INTERVAL})" in result.stdout
    assert len(losses(out)) == STEPS + 2
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == sorted(set(logged)), "a step the resumed run repeated is in metrics.jsonl twice"


def test_a_marker_without_the_data_position_resumes_from_the_first_sample(tmp_path):
    out = tmp_path / "out"
    config = copied_run("single", tmp_path)  # checkpoints at steps 10, 20 and 30
    marker = out / "checkpoints" / f"step_{STEPS:07d}" / "COMPLETE"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "sampler"}))
    result = train(config, 1, f"training.max_steps={STEPS + 2}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(step {STEPS})" in result.stdout and "holds no data position" in result.stdout, result.stdout[-2000:]
    assert len(losses(out)) == STEPS + 2


def test_a_run_resumed_with_more_steps_takes_its_first_step_at_its_own_schedules_lr(tmp_path):
    """The cosine now spans 40 steps: step 31's lr is the new schedule's at step 30, not the 30-step run's (the lr
    the checkpoint's optimizer held, set for step 31 by the old schedule), and a note says so."""
    from distsetup.training.optim import lr_lambda

    out = tmp_path / "out"
    config = copied_run("single", tmp_path)  # finished at step STEPS
    result = train(config, 1, f"training.max_steps={STEPS + 10}")
    assert result.returncode == 0, result.stderr[-3000:]
    lrs = {row["step"]: row["lr"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    warmup, peak = TRAINING["warmup_steps"], TRAINING["lr"]
    assert lrs[STEPS + 1] == pytest.approx(peak * lr_lambda(warmup, STEPS + 10, 0.1)(STEPS), rel=1e-12)
    assert lrs[STEPS] == pytest.approx(peak * lr_lambda(warmup, STEPS, 0.1)(STEPS - 1), rel=1e-12)  # the first run's
    assert f"note: this run's schedule spans {STEPS + 10} steps: lr " in result.stdout, result.stdout[-2000:]


def test_a_run_that_finds_no_checkpoint_sets_the_previous_runs_metrics_aside(tmp_path):
    """A crash before the first checkpoint (a folder without its marker): the next start begins at step 0, and the
    crashed run's metrics go aside rather than under the new run's (or deleted); the checkpoints folder stays."""
    out = tmp_path / "out"
    config = write_run_config(tmp_path, "single", max_steps=2)
    (out / "checkpoints" / "step_0000005").mkdir(parents=True)  # stopped mid-save: no COMPLETE marker
    crashed = '{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n'
    (out / "metrics.jsonl").write_text(crashed)
    result = train(config, 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: no checkpoint to resume: moved the previous run's record to" in result.stdout, result.stdout[-2000:]
    (previous,) = out.glob("previous-*")
    assert (previous / "metrics.jsonl").read_text() == crashed and not (previous / "checkpoints").exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# A run of its own model and data whose loss sends SIGTERM to its own process at call STOP_AT_CALL: SLURM's warning
# arriving during a chosen step.
STOPS_ITSELF = """\
import os
import signal

import torch

calls = 0


def build_model():
    return torch.nn.Linear(4, 1)


def build_data(split):
    inputs = torch.randn(32, 4, generator=torch.Generator().manual_seed(len(split)))
    return torch.utils.data.TensorDataset(inputs, inputs.sum(-1, keepdim=True))


def loss(model, batch):
    global calls
    calls += 1
    if calls == int(os.environ.get("STOP_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGTERM)
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)
"""


def test_a_run_stopped_at_its_last_step_checkpoints_it_and_one_resumed_there_evaluates_it(tmp_path):
    """Stopped during its last step, a run writes the last checkpoint (trusted, as a finished run's) and leaves its
    last evaluation, which would outlast a scheduler's grace period, to the run started again: that one trains
    nothing, evaluates, and writes the summary without the pace it has none of. Bug before: the resumed run wrote a
    summary of 0 samples/s with the evaluation before."""
    (tmp_path / "stops_itself.py").write_text(STOPS_ITSELF)
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    training = {"micro_batch_size": 8, "max_steps": 3, "eval_interval": 2, "log_interval": 1, "output_dir": str(out)}
    config.write_text(
        json.dumps(
            {
                "model": {"type": "python", "builder": "stops_itself:build_model"},
                "data": {"type": "python", "builder": "stops_itself:build_data"},
                "training": {**training, "loss": "stops_itself:loss"},
            }
        )
    )
    stopped = train(config, 1, env={"STOP_AT_CALL": "7"})  # the third step's forward, after step 2's 4 evaluations
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "asked to stop at the last step, 3: its training is done, its evaluation runs when" in stopped.stdout
    assert "preempted: checkpoint at step 3" in stopped.stdout and not (out / "summary.json").exists()
    marker = json.loads((out / "checkpoints" / "step_0000003" / "COMPLETE").read_text())
    assert "confirmed" not in marker and "val_loss" not in marker  # trusted; written before the evaluation
    resumed = train(config, 1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [2, 3] and summary["steps"] == 3
    assert summary["samples_per_s"] is None and summary["steps_per_s"] is None
    assert "done: 3 steps, final loss" in resumed.stdout and "samples/s" not in resumed.stdout
    marker = json.loads((out / "checkpoints" / "step_0000003" / "COMPLETE").read_text())
    assert marker["val_loss"] == summary["evals"][-1]["val_loss"]  # the evaluation after it, in its marker
    evaluations = (out / "metrics.jsonl").read_text().count("val_loss")
    assert train(config, 1).returncode == 0  # the finished run started again: no evaluation again
    assert (out / "metrics.jsonl").read_text().count("val_loss") == evaluations == 2


@pytest.mark.parametrize("stop_at_call", [2, 3], ids=["in the step", "in its evaluation"])
def test_a_run_stopped_at_an_evaluations_step_evaluates_it_when_resumed(tmp_path, stop_at_call):
    """Bug: stopped during a step it evaluates at (not the last), a run checkpointed without that evaluation, and the
    run resumed from it went on to the next step: the evaluation was never run (metrics and `checkpoint ls` lacked
    it); then, run, it was missing from its checkpoint's marker. And a stop during the evaluation waited for its end
    (minutes, on a real validation set, past a scheduler's grace period): the ranks agree to stop between its
    batches, as between steps."""
    (tmp_path / "stops_itself.py").write_text(STOPS_ITSELF)
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    training = {"micro_batch_size": 8, "max_steps": 3, "eval_interval": 2, "log_interval": 1, "output_dir": str(out)}
    run = {
        "model": {"type": "python", "builder": "stops_itself:build_model"},
        "data": {"type": "python", "builder": "stops_itself:build_data"},
        "training": {**training, "loss": "stops_itself:loss"},
    }
    config.write_text(json.dumps(run))
    # the second step's forward, or the first of the 4 validation batches after it
    stopped = train(config, 1, env={"STOP_AT_CALL": str(stop_at_call)})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "val_loss" not in (out / "metrics.jsonl").read_text()
    assert "preempted: checkpoint at step 2" in stopped.stdout
    resumed = train(config, 1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [2, 3] and "step 2: validation loss" in resumed.stdout
    # and in the marker of the checkpoint it was left out of (`checkpoint ls` showed none: walk)
    marker = json.loads((out / "checkpoints" / "step_0000002" / "COMPLETE").read_text())
    assert marker["val_loss"] == summary["evals"][0]["val_loss"]


def test_starting_a_finished_run_again_keeps_its_summary(tmp_path):
    """Nothing is left to train: the run's summary.json stays (it was rewritten with 0 tokens/s and no pace)."""
    out = tmp_path / "out"
    config = copied_run("single", tmp_path)  # finished at step STEPS
    summary = (out / "summary.json").read_text()
    result = train(config, 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"done: the run is at step {STEPS} of {STEPS} already; {out / 'summary.json'}" in result.stdout
    assert (out / "summary.json").read_text() == summary and json.loads(summary)["tokens_per_s"] > 0


def test_content_damage_of_the_same_size_is_one_line_naming_the_folder(tmp_path):
    out = tmp_path / "out"
    config = copied_run("single", tmp_path)  # checkpoints at steps 10, 20 and 30
    rng = out / "checkpoints" / f"step_{STEPS:07d}" / "rng_rank0.pt"
    rng.write_bytes(b"\xff" * rng.stat().st_size)
    result = train(config, 1, f"training.max_steps={STEPS + 2}")
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"cannot load checkpoint {rng.parent}" in lines[0] and "--no_resume" in lines[0]


def test_one_output_dir_holds_one_run_and_a_killed_run_leaves_it_free(tmp_path):
    """The lock of one run an output folder holds, freed when its ranks end; and ranks whose launcher is killed
    outright (SIGKILL, the OOM killer) end: torchrun starts each in a session of its own, and they trained on, holding
    the lock. Each rank asks Linux for SIGTERM when its launcher dies: a preemption, which checkpoints and stops."""
    config = write_run_config(tmp_path, "ddp", checkpoint_interval=5, max_steps=10_000)
    first = start(config, 2)
    wait_for(tmp_path / "out" / "checkpoints" / "step_0000005" / "COMPLETE", first)
    second = train(config, 1, "distributed.backend=single", "training.seed=99")
    lines = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode == 1 and len(lines) == 1, second.stderr[-2000:]
    ranks = worker_pids(first.pid)
    assert "is in use by another run" in lines[0] and f"pid {ranks[0]}" in lines[0]
    assert first.poll() is None  # the first run goes on untouched

    os.kill(first.pid, signal.SIGKILL)  # the launcher alone
    first.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # not left behind by a failing test
        os.kill(pid, signal.SIGKILL)
    log = first.log.read_text()
    assert not alive and len(ranks) == 2, log[-3000:]
    step = int(re.findall(r"preempted: checkpoint at step (\d+)", log)[0])
    assert (tmp_path / "out" / "checkpoints" / f"step_{step:07d}" / "COMPLETE").exists()
    resumed = train(config, 2, f"training.max_steps={step + 2}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resumed from \S+step_\d+ \(step \d+\)", resumed.stdout)


def test_a_stopped_deepspeed_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    """DeepSpeed reduces over groups of its own, which took torch's 30-minute default instead of the run's."""
    config = write_run_config(tmp_path, "zero2", checkpoint_interval=5, max_steps=100_000, log_interval=50)
    run = start(config, 2, "distributed.timeout_minutes=0.3")
    wait_for(tmp_path / "out" / "checkpoints" / "step_0000005" / "COMPLETE", run)
    stopped = worker_pids(run.pid)[-1]
    os.kill(stopped, signal.SIGSTOP)
    began = time.monotonic()
    lost = re.compile(r"error: rank 0 of 2 lost contact with the other ranks at step \d+ .*distributed.timeout_minutes")
    try:
        while not lost.search(run.log.read_text()) and run.poll() is None and time.monotonic() - began < 120:
            time.sleep(0.5)
        waited = time.monotonic() - began
    finally:  # torchrun would give the stopped rank 30 s more before SIGKILL: not this test's subject
        os.kill(stopped, signal.SIGKILL)
        run.kill()
        run.wait()
    log = run.log.read_text()
    assert lost.search(log), log[-3000:]
    assert waited < 48  # the 18 s timeout, not torch's 30 minutes
    assert "[rank0]: Traceback" not in log


def test_full_disk_during_a_checkpoint_is_one_line_with_the_free_space(tmp_path):
    """The output folder on a 256 KiB tmpfs (a private mount namespace, gone with the process): the first
    checkpoint (about 0.5 MiB) cannot be written."""
    disk = tmp_path / "disk"
    disk.mkdir()
    config = write_run_config(tmp_path, "single", checkpoint_interval=2, max_steps=4)
    result = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            'mount -t tmpfs -o size=256k tmpfs "$1" && shift && exec "$@"',
            "sh",
            str(disk),
            *command(config, 1, f"training.output_dir={disk / 'out'}"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(),
        cwd=REPO,
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"cannot write checkpoint {disk / 'out' / 'checkpoints' / 'step_0000002'}" in lines[0]
    assert re.search(r"; \d+\.\d MiB free on that disk", lines[0]), lines[0]


RESIZED = """\
import torch


def build_model(hidden):
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))


def build_data(split):
    inputs = torch.randn(32, 4, generator=torch.Generator().manual_seed(len(split)))
    return torch.utils.data.TensorDataset(inputs, inputs.sum(-1, keepdim=True))


def loss(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)
"""


def test_a_checkpoint_of_another_model_section_says_what_changed(tmp_path):
    """A python model's model.args changed since its checkpoints: the load said "move step_N aside to resume from
    the checkpoint before it", of which every one fails alike. It names what changed, once for the node."""
    (tmp_path / "resized.py").write_text(RESIZED)
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    run = {
        "model": {"type": "python", "builder": "resized:build_model", "args": {"hidden": 8}},
        "data": {"type": "python", "builder": "resized:build_data"},
        "training": {"micro_batch_size": 8, "max_steps": 2, "output_dir": str(out), "loss": "resized:loss"},
    }
    config.write_text(json.dumps(run))
    assert train(config, 1).returncode == 0
    # on 2 processes: said once for the node (each rank said it)
    resumed = train(config, 2, "model.args.hidden=16", "training.max_steps=4")
    said = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert resumed.returncode == 1 and len(said) == 1, resumed.stderr[-3000:]
    assert f"cannot load checkpoint {out / 'checkpoints' / 'step_0000002'}: the run config's model section" in said[0]
    assert "(model.args.hidden 8 there, 16 here)" in said[0], said[0]
    assert "HINT: resume with the model section it was trained with, or start afresh" in said[0]

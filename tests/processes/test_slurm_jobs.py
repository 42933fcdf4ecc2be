"""Real processes for SLURM: torchrun honours the grace period the requeue script exports, and jobs on a real
two-node SLURM cluster on loopback (tests/support/slurm_cluster.py) run as one world (the deepspeed launcher's, and
torchrun's from `distsetup init --yes`), from another folder too, and checkpoint and resume when requeued, with
torchrun and with the deepspeed launcher. Every test of the cluster is in this module, which `make test` keeps on one
pytest-xdist worker (tests/conftest.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch_inputs import WEIRD
from process_tree import parent
from shell_checks import shellcheck
from slurm_scripts import GRACE, build

VENV = Path(sys.executable).parent.parent


def test_torchrun_honours_the_grace_period(tmp_path):
    """The variable the requeue script exports makes torchrun wait before SIGKILL: a worker that needs
    3 s after SIGTERM finishes with the script's grace period, and is killed with a 1 s one."""
    grace = int(GRACE.search(build(requeue=True, signal_seconds=20)).group(1))
    assert grace == 10
    worker = tmp_path / "worker.sh"
    worker.write_text(
        '#!/bin/bash\ntrap \'sleep 3; touch "$1.done"; exit 0\' TERM\ntouch "$1.ready"\n'
        "while true; do sleep 0.1; done\n"
    )
    worker.chmod(0o755)
    procs = {}
    for name, timeout in (("grace", grace), ("short", 1)):
        env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(timeout), "OMP_NUM_THREADS": "1"}
        procs[name] = subprocess.Popen(
            ["torchrun", "--standalone", "--nproc_per_node", "1", "--no_python", str(worker), str(tmp_path / name)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + 120
    for name, proc in procs.items():
        while not (tmp_path / f"{name}.ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        proc.communicate(timeout=60)
    assert (tmp_path / "grace.done").exists()
    assert not (tmp_path / "short.done").exists()


# --- a real two-node SLURM cluster ---------------------------------------------------------------


def slurm_project(root: Path, max_steps: int, checkpoint_interval: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(f"""\
model: {{n_layer: 1, n_head: 2, n_embd: 32, block_size: 16}}
data: {{num_samples: 512}}
training: {{max_steps: {max_steps}, warmup_steps: 1, checkpoint_interval: {checkpoint_interval}, log_interval: 5,
           micro_batch_size: 4, output_dir: {json.dumps(str(root / "out"))}}}
distributed: {{backend: ddp}}
""")
    return root


def submit(run_cli, cluster, root: Path, *args, sbatch: tuple[str, ...] = (), train: tuple[str, ...] = ()) -> str:
    """A two-node job running distsetup's trainer (python -m distsetup.train), submitted from `root` (`sbatch`: the
    options sbatch is given; `train`: the script's arguments, for the trainer)."""
    script = root / "job.sh"
    result = run_cli(
        "slurm",
        "--config",
        root / "config.yaml",
        "--num_nodes",
        2,
        "--num_gpus_per_node",
        1,
        "--venv",
        VENV,
        "--cpus_per_task",
        1,
        "--time_limit",
        10,
        "--env",
        "OMP_NUM_THREADS=1",
        "-o",
        script,
        *args,
    )
    assert result.exit_code == 0, result.output
    shellcheck([script])
    return cluster.run("sbatch", "--parsable", *sbatch, str(script), *train, cwd=root).stdout.strip().split(";")[0]


def job_log(root: Path, job_id: str, name: str = "distsetup") -> str:
    return (root / f"{name}-{job_id}.out").read_text(errors="replace")


def started_log(root: Path, job_id: str) -> str:
    """The job's log, empty before the job has started."""
    return job_log(root, job_id) if (root / f"distsetup-{job_id}.out").exists() else ""


def test_job_submitted_from_another_folder_trains(run_cli, cluster, tmp_path, monkeypatch):
    """A job written in the project with relative paths and submitted from another folder (`cd jobs && sbatch
    ../scripts/slurm_job.sh`) trains on both nodes, its output where the run config says; submitted with a bad
    argument first, it stops in its batch shell with one line."""
    root = slurm_project(tmp_path / "project", max_steps=2, checkpoint_interval=2)
    config = (root / "config.yaml").read_text().replace(json.dumps(str(root / "out")), "out")  # relative too
    (root / "config.yaml").write_text(config)
    monkeypatch.chdir(root)
    result = run_cli(
        "slurm",
        "--config",
        "config.yaml",
        "--num_nodes",
        2,
        "--num_gpus_per_node",
        1,
        "--venv",
        VENV,
        "--cpus_per_task",
        1,
        "--time_limit",
        10,
        "--env",
        "OMP_NUM_THREADS=1",
    )
    assert result.exit_code == 0, result.output
    shellcheck([root / "scripts" / "slurm_job.sh"])
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    # The batch shell checks the run config and the arguments once, before srun: a bad one is one line, no node starts
    bad = cluster.run("sbatch", "--parsable", "../project/scripts/slurm_job.sh", "training.lerning_rate=0.1", cwd=jobs)
    job = cluster.run("sbatch", "--parsable", "../project/scripts/slurm_job.sh", cwd=jobs).stdout.split(";")[0].strip()
    bad_job = bad.stdout.split(";")[0].strip()
    bad_state, bad_log = cluster.wait_job(bad_job, timeout=150), job_log(jobs, bad_job)
    assert bad_state["JobState"] == "FAILED", bad_log[-4000:]
    said = [line for line in bad_log.splitlines() if "lerning_rate" in line]
    assert len(said) == 1 and said[0].startswith("error: run config problem"), bad_log[-4000:]
    assert "node_rank" not in bad_log and "torchrun" not in bad_log, bad_log[-4000:]
    state = cluster.wait_job(job, timeout=150)
    log = job_log(jobs, job)  # SLURM writes the log where sbatch ran
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert "node n1: node_rank 0 of 2" in log and "node n2: node_rank 1 of 2" in log
    summary = json.loads((root / "out" / "summary.json").read_text())  # output_dir: relative to the project
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert not (jobs / "out").exists()


def wait_for_checkpoint(cluster, folder: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (folder / "COMPLETE").exists():
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)


def node_program(job: str, node_rank: int) -> int:
    """The process id of the program that srun runs on node `node_rank` of job `job` (both nodes are this machine)."""
    wanted = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_NODEID={node_rank}".encode()}
    for entry in Path("/proc").iterdir():
        try:
            if wanted <= set((entry / "environ").read_bytes().split(b"\0")):
                if Path(f"/proc/{parent(int(entry.name))}/comm").read_text().strip() == "slurmstepd":
                    return int(entry.name)
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no program of job {job} on node {node_rank}")


def test_requeue_checkpoints_and_resumes(run_cli, cluster, tmp_path):
    """Stopped twice, each time with a checkpoint that the requeued job resumes from, and said in the job's log; a
    job submitted with --no_resume too (SLURM requeues it with the same arguments: it started over each time)."""
    root = slurm_project(tmp_path / "requeue", max_steps=300, checkpoint_interval=5)
    job = submit(run_cli, cluster, root, "--requeue", "--signal_seconds", 60, train=("--no_resume",))
    checkpoints = root / "out" / "checkpoints"
    # USR1 to the job steps as soon as they start, while the ranks set up (or, on a quick machine, train): requeued
    # all the same (during set-up the ranks stopped without a checkpoint or a word of it, and the job FAILED). First
    # to node 1 alone, as SLURM's notices may reach the nodes seconds apart: its quick end had srun end the step
    # before node 0, which tells the batch shell, took its own, and the job FAILED unrequeued.
    deadline = time.monotonic() + 120
    while not all(f"node_rank {rank} of 2" in started_log(root, job) for rank in (0, 1)):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    os.kill(node_program(job, node_rank=1), signal.SIGUSR1)
    time.sleep(3)
    cluster.run("scancel", "--signal=USR1", job)
    deadline = time.monotonic() + 200
    while job_log(root, job).count("node_rank 0 of 2") < 2:  # requeued, started again
        assert time.monotonic() < deadline, job_log(root, job)[-4000:] + cluster.logs()
        time.sleep(0.5)
    wait_for_checkpoint(cluster, checkpoints / "step_0000005")  # training is under way
    # USR1 to the job steps, as `scancel --signal=USR1 JOB` or a site's --signal=USR1@N (without B:) send it: it
    # ended torchrun (no handler), the ranks trained on alone and the job FAILED. (What the script asks SLURM for,
    # USR1 to the batch shell, the deepspeed launcher's test below sends.)
    cluster.run("scancel", "--signal=USR1", job)
    deadline = time.monotonic() + 200
    while not (resumed := re.search(r"resumed from .* \(step (\d+)\)", job_log(root, job))):  # requeued, trains
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    wait_for_checkpoint(cluster, checkpoints / f"step_{(int(resumed.group(1)) // 5 + 1) * 5:07d}")
    # SIGTERM to every process of the job, the batch shell too (scontrol requeue, as a preemption by another job):
    # the checkpoint was written, but srun, which relays the ranks' output, died with the batch shell before their
    # line "preempted: checkpoint at step N" reached the log; SLURM requeues the job itself.
    cluster.run("scontrol", "requeue", job)
    state = cluster.wait_job(job, timeout=300)
    log = job_log(root, job)
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert state["Restarts"] == "3", log[-4000:]
    assert log.count("distsetup: preempted: requeueing job") == 2  # the third, SLURM's own
    # the requeue after a stop during set-up resumes where that start had set the previous record aside already
    assert log.count("note: --no_resume is for the run's first start: SLURM requeued the job") in (2, 3), log[-4000:]
    preempted = [line for line in log.splitlines() if line.startswith("preempted: checkpoint at step ")]
    steps = [int(line.rsplit(" ", 1)[1]) for line in preempted][-2:]  # a first one where set-up was quick
    assert len(preempted) in (2, 3) and 5 <= steps[0] < steps[1] < 300, log[-4000:]
    for step in steps:
        assert (checkpoints / f"step_{step:07d}" / "COMPLETE").exists()
        assert f"resumed from {checkpoints / f'step_{step:07d}'} (step {step})" in log
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["world_size"] == 2


def test_a_time_limit_no_longer_than_the_warning_stops_the_job_before_it_trains(run_cli, cluster, tmp_path):
    """sbatch --time=2 (minutes) over a script that asks SLURM to warn 120 s before the time limit: warned at once,
    each run would checkpoint and requeue, without end. The job stops with one line, unrequeued, before srun."""
    root = slurm_project(tmp_path / "short", max_steps=300, checkpoint_interval=5)
    job = submit(run_cli, cluster, root, "--requeue", "--signal_seconds", 120, sbatch=("--time=2",))
    state = cluster.wait_job(job, timeout=120)
    log = job_log(root, job)
    assert (state["JobState"], state["Restarts"]) == ("FAILED", "0"), log[-4000:]
    assert f"distsetup: job {job}'s time limit, 2:00, is not longer than the 120 s warning" in log, log[-4000:]
    assert "node_rank" not in log and not (root / "out").exists()  # no process started


# A program that takes 3 s to checkpoint after SIGTERM, then waits for the other rank's (as the trainer's barrier
# does) and exits 75; requeued, it finds its checkpoint and ends, or says it was lost.
SLOW_CHECKPOINT = """\
import os, signal, sys, time
from pathlib import Path

marks, rank, world = Path("marks"), os.environ["RANK"], os.environ["WORLD_SIZE"]
marks.mkdir(exist_ok=True)
if (marks / "preempted").exists():
    (marks / f"{'resumed' if (marks / f'saved{rank}').exists() else 'lost'}{rank}").write_text(world)
    sys.exit(0 if (marks / f"saved{rank}").exists() else 1)


def checkpoint(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (marks / "preempted").touch()
    time.sleep(3)
    (marks / f"saved{rank}").write_text(world)
    while len(list(marks.glob("saved*"))) < int(world):
        time.sleep(0.1)
    sys.exit(75)


signal.signal(signal.SIGTERM, checkpoint)
(marks / f"ready{rank}").write_text(world)
while True:
    time.sleep(0.1)
"""


def test_the_deepspeed_launcher_lives_until_its_ranks_have_checkpointed(run_cli, cluster, tmp_path, monkeypatch):
    """SLURM signals every process of the job; the deepspeed launcher (runner.py) dies of SIGTERM, and srun then kills
    its step: a checkpoint that takes longer than that was lost. The job, in a folder and under a name that need
    quoting, with the preflight, is one world of 2 nodes whose ranks finish their checkpoint and resume requeued."""
    root = slurm_project(tmp_path / WEIRD, max_steps=1, checkpoint_interval=1)
    (root / "slow.py").write_text(SLOW_CHECKPOINT)
    monkeypatch.chdir(root)  # the job's folder: where distsetup ran
    job = submit(
        run_cli,
        cluster,
        root,
        "--script",
        "slow.py",
        "--launch_method",
        "deepspeed",
        "--preflight",
        "--requeue",
        "--signal_seconds",
        60,
        "--job_name",
        'two "nodes"',
    )
    marks, deadline = root / "marks", time.monotonic() + 120
    while len(list(marks.glob("ready*"))) < 2:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    state = cluster.wait_job(job, timeout=200)
    log = job_log(root, job, name='two "nodes"')
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert (state["Restarts"], state["NodeList"]) == ("1", "n[1-2]"), log[-4000:]
    assert "node n1: node_rank 0 of 2" in log and "node n2: node_rank 1 of 2" in log
    assert log.count("preflight OK: 2 ranks") == 2, log[-4000:]  # before the first run and the requeued one
    assert sorted(p.name for p in marks.iterdir() if p.name != "preempted") == [
        f"{kind}{rank}" for kind in ("ready", "resumed", "saved") for rank in (0, 1)
    ]
    assert {p.read_text() for p in marks.iterdir() if p.name != "preempted"} == {"2"}


def test_init_yes_for_two_slurm_nodes_runs_as_one_world(run_cli, cluster, tmp_path, monkeypatch):
    project = tmp_path / "we ird 'dir\" $x"  # every path in the script is quoted
    project.mkdir()
    monkeypatch.chdir(project)
    result = run_cli(
        "init",
        "--yes",
        "--scheduler",
        "slurm",
        "--num_nodes",
        2,
        "--num_gpus_per_node",
        1,
        "--time_limit",
        10,
        "--gpu_memory",
        "none",  # the test cluster's nodes have no real GPUs: a CPU job
        "--venv",
        VENV,
        "--max_steps",
        4,
    )
    assert result.exit_code == 0, result.output
    assert "Next: sbatch scripts/slurm_job.sh" in result.stdout
    shellcheck([project / "scripts" / "slurm_job.sh"])
    job = cluster.run("sbatch", "--parsable", "scripts/slurm_job.sh", cwd=project).stdout.strip().split(";")[0]
    state = cluster.wait_job(job, timeout=150)
    log = (project / f"distsetup-{job}.out").read_text(errors="replace")
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert state["NodeList"] == "n[1-2]"
    assert "node n1: node_rank 0 of 2" in log and "node n2: node_rank 1 of 2" in log
    summary = json.loads((project / "runs" / "tiny" / "summary.json").read_text())
    assert (summary["backend"], summary["world_size"], summary["steps"]) == ("ddp", 2, 4)

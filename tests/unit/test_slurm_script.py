"""The SLURM job script: one world across nodes with per-node values expanding on each node, its sections, set-up
and requeue lines, the folder it enters, golden files, and shellcheck over a grid of scripts and their per-node
programs."""

import contextlib
import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from golden_files import GOLDEN_DIR, check_golden
from launch_inputs import ACCELERATE_HYBRID_FSDP, WEIRD
from shell_checks import job_shell, shellcheck, srun_program
from slurm_scripts import build, spec

from distsetup.scripts.environment import EnvSpec
from distsetup.scripts.sbatch import build_slurm_script

# --- the script ----------------------------------------------------------------------------------


def test_one_world_across_nodes_with_per_node_values_expanding_on_each_node():
    text = build()
    program = srun_program(text)
    assert 'srun "${SRUN_ARGS[@]}" bash -c \'' in text
    assert "--ntasks-per-node=1" in text and "--export=ALL" in text  # the variables reach the nodes
    assert 'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in text
    assert 'export MASTER_ADDR="${HOSTS[0]:?' in text
    assert 'export MASTER_PORT="$((20000 + SLURM_JOB_ID % 12000))"' in text
    assert 'NODE_RANK="$SLURM_NODEID"' in program  # inside the single quotes: expands per node
    outside = job_shell(text)
    assert not [line for line in outside.splitlines() if "SLURM_NODEID" in line and not line.startswith("#")]
    assert '--nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE"' in program
    assert '--rdzv_id "$RDZV_ID"' in program and 'export RDZV_ID="$SLURM_JOB_ID"' in text
    assert "'" not in program  # nothing can end the quoting early


def test_fixed_port_and_sections():
    text = build(launch={"master_port": 29500})
    assert "export MASTER_PORT=29500" in text
    headers = [line for line in text.splitlines() if line.startswith("# --- ")]
    assert headers == ["# --- parameters ---", "# --- environment ---", "# --- command ---"]
    assert text.index("#SBATCH") < text.index("set -euo pipefail")


def test_deepspeed_launcher_per_node_with_hostfile_and_no_ssh():
    program = srun_program(
        build(launch={"launch_method": "deepspeed", "backend": "deepspeed", "deepspeed_config": "ds.json"})
    )
    assert '--no_ssh --node_rank "$NODE_RANK"' in program
    assert 'echo "$host slots=$NPROC_PER_NODE"' in program
    assert "--num_gpus" not in program  # never `srun deepspeed --num_gpus=8` alone


def test_setup_lines():
    text = build(
        modules=("cuda/12.4", "nccl"),
        venv=f"{WEIRD}/.venv",
        launch={"env": EnvSpec(extra=(("WANDB_MODE", "offline"), ("NOTE", WEIRD)))},
    )
    assert "module load cuda/12.4\nmodule load nccl\n" in text
    assert "VENV='we ird '\"'\"'dir\" $x/.venv'" in text and 'source "$VENV/bin/activate"' in text
    assert "export WANDB_MODE=offline" in text
    assert "conda activate 'my env'" in build(conda_env="my env")


def test_job_enters_the_folder_it_was_written_in_before_anything_else():
    """SLURM runs the batch script in the folder sbatch ran in: the script enters the folder distsetup ran in before
    the set-up lines (a relative --venv means the same) and on every node, so `cd jobs && sbatch
    ../scripts/slurm_job.sh` finds src/train.py and every relative path."""
    text = build(venv=".venv", modules=("cuda/12.4",), launch={"workdir": f"/{WEIRD}"})
    assert "export WORKDIR='/we ird '\"'\"'dir\" $x'" in text
    setup = ['cd "$WORKDIR" ||', "module load", "VENV=.venv", 'source "$VENV/bin/activate"']
    assert [text.index(line) for line in setup] == sorted(text.index(line) for line in setup)
    assert 'cd "$WORKDIR"' in srun_program(text)
    assert "MODULE=distsetup.train" in text and 'exec "${LAUNCH[@]}" -m "$MODULE" "$@") &' in srun_program(text)


def test_requeue_trap_forwards_term_and_requeues():
    text = build(requeue=True)
    assert "trap forward_preemption USR1" in text
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    # requeued however the steps were signalled, but where SLURM terminates the job (and requeues it or not) itself
    assert 'if ((!terminated && status != 0)) && [[ -e "$DISTSETUP_PREEMPTED_FILE" ]]' in text
    assert text.index('trap "terminated=1" TERM') < text.index('srun "${SRUN_ARGS[@]}"')
    # the node's shell takes USR1 from its first line, before it says it started (the signal may come then), and
    # hands torchrun TERM instead; torchrun, its child, starts with USR1 ignored
    program = srun_program(text)
    assert program.index("trap take_preemption_notice USR1") < program.index("node_rank $NODE_RANK of")
    assert '(trap "" USR1 && exec "${LAUNCH[@]}" -m "$MODULE" "$@") &' in program


# a launcher that trains until SIGTERM; SLURM's scontrol, which the deepspeed launcher's node program asks for the hosts
FAKE_LAUNCHER = """#!/bin/bash
trap 'exit 143' TERM
echo started >>"$MARKS/launcher"
while :; do sleep 0.1; done
"""
FAKE_SCONTROL = """#!/bin/bash
printf "n1\\nn2\\n"
"""
# the node program asks for the node's name where SLURM gave none: this one signals that program meanwhile
USR1_FROM_HOSTNAME = """#!/bin/bash
until [[ -s "$MARKS/node_pid" ]]; do sleep 0.01; done
kill -USR1 "$(cat "$MARKS/node_pid")"
echo n1
"""


# a torchrun that, told to stop, waits a second for its ranks' checkpoint, as torchrun does (a second SIGTERM would cut
# that wait short: torch's elastic agent raises out of it)
STOPPING_TORCHRUN = """#!/bin/bash
trap 'echo SIGTERM >>"$MARKS/launcher_got"; stopping=1' TERM
stopping=0
echo started >>"$MARKS/launcher"
until ((stopping)); do sleep 0.1; done
sleep 1
exit 143
"""


def wait_until(condition, seconds: float = 30) -> None:
    """Polls `condition` every 0.1 s until it holds or `seconds` have passed (the test's asserts then say what)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def start_node_program(
    tmp_path, launcher: str, tools: dict[str, str], node_rank: int = 0, preflight: bool = False
) -> tuple[subprocess.Popen, Path]:
    """The program of node `node_rank` of a requeueing job of 2 nodes (with --preflight), started with the fake `tools`
    (name: body) first on PATH; returns it and the folder of marks the fakes and the program leave."""
    marks = tmp_path / "marks"
    marks.mkdir()
    launch = {"launch_method": launcher, "preflight": preflight}
    (tmp_path / "node.sh").write_text(srun_program(build(requeue=True, launch=launch)))
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for name, body in tools.items():
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env |= {"PATH": f"{fake}:{env['PATH']}", "MARKS": str(marks), "TMPDIR": str(tmp_path), "WORKDIR": str(tmp_path)}
    env |= {"SLURM_NODEID": str(node_rank), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "NNODES": "2"}
    env |= {"NPROC_PER_NODE": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "20001", "RDZV_ID": "7"}
    env |= {"MODULE": "distsetup.train", "DISTSETUP_PREEMPTED_FILE": str(marks / "preempted")}
    node = subprocess.Popen(["bash", str(tmp_path / "node.sh"), "distsetup-node"], env=env)
    (marks / "node_pid").write_text(str(node.pid))
    return node, marks


@pytest.mark.parametrize("launcher, status", [("torchrun", 143), ("deepspeed", 138)])
def test_a_usr1_before_the_launcher_has_started_stops_the_node_and_marks_the_preemption(launcher, status, tmp_path):
    """SLURM may send USR1 to the job steps while a node's program still sets up, before the launcher exists (a real
    cluster hit it only now and then, as the job started: the node's shell died of it, no checkpoint, no requeue).
    The shell takes it from its first line, and node 0 marks the preemption for the batch shell, which then requeues
    the job. torchrun, which starts with USR1 ignored, stops as it starts (SIGTERM: 143); the deepspeed launcher,
    which would never get the signal, does not start (138, as if it had died of USR1)."""
    tools = {launcher: FAKE_LAUNCHER, "scontrol": FAKE_SCONTROL, "hostname": USR1_FROM_HOSTNAME}
    node, marks = start_node_program(tmp_path, launcher, tools)
    with node:
        ended = node.wait(timeout=30)
    # before, the shell died of USR1 (-10) and marked nothing
    assert (ended, (marks / "preempted").exists()) == (status, True)
    if launcher == "deepspeed":
        assert not (marks / "launcher").exists()


@pytest.mark.parametrize(
    "launcher, preflight, status", [("torchrun", False, 143), ("deepspeed", False, 138), ("torchrun", True, 138)]
)
def test_another_node_stopped_by_the_notice_ends_with_the_step(launcher, preflight, status, tmp_path):
    """Node 1, stopped by a notice, ends when SLURM ends the step (SIGTERM), not at once: its end had srun end the step
    (--kill-on-bad-exit) before node 0, which tells the batch shell, took the same notice (a real cluster's notices
    came seconds apart now and then), and the job failed unrequeued. Node 1 marks nothing itself. With --preflight,
    the notice ends the preflight's launcher (it has no USR1 ignored), 138."""
    tools = {"scontrol": FAKE_SCONTROL, "hostname": USR1_FROM_HOSTNAME}
    tools[launcher] = "#!/bin/bash\nexit 138\n" if preflight else FAKE_LAUNCHER
    node, marks = start_node_program(tmp_path, launcher, tools, node_rank=1, preflight=preflight)
    with node:
        # until it waits: before, it ended at once
        wait_until(lambda: node.poll() is not None or "sleep" in children_names(node.pid))
        assert node.poll() is None
        node.send_signal(signal.SIGTERM)
        ended = node.wait(timeout=5)
    assert (ended, (marks / "preempted").exists()) == (status, False)


def children_names(pid: int) -> list[str]:
    """The command names of the processes that `pid` started."""
    names = []
    with contextlib.suppress(OSError):  # ended meanwhile
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            names.append(Path(f"/proc/{child}/comm").read_text().strip())
    return names


def test_another_node_whose_step_ends_while_torchrun_stops_ends_with_it(tmp_path):
    """The usual case of a notice to every node: node 0 ends first, SLURM ends the step (SIGTERM) while node 1's
    torchrun still stops. Node 1 then ends as soon as torchrun has, not 10 s later."""
    tools = {"torchrun": STOPPING_TORCHRUN, "hostname": "#!/bin/bash\necho n1\n"}
    node, marks = start_node_program(tmp_path, "torchrun", tools, node_rank=1)
    with node:
        wait_until(lambda: (marks / "launcher").exists())  # torchrun has started
        node.send_signal(signal.SIGUSR1)
        time.sleep(0.3)  # torchrun stopping, for a second
        node.send_signal(signal.SIGTERM)
        ended = node.wait(timeout=5)
    assert ended == 143


def test_a_second_notice_hands_torchrun_no_second_sigterm(tmp_path):
    """Two notices while torchrun waits for its ranks' checkpoint (scancel --signal=USR1 twice, say) give it one
    SIGTERM: before, each USR1 handed on another, which ends torchrun's wait while its ranks still write."""
    tools = {"torchrun": STOPPING_TORCHRUN, "hostname": "#!/bin/bash\necho n1\n"}
    node, marks = start_node_program(tmp_path, "torchrun", tools)
    with node:
        wait_until(lambda: (marks / "launcher").exists())  # torchrun has started
        for _ in range(2):
            node.send_signal(signal.SIGUSR1)
            time.sleep(0.3)  # the first handled and torchrun stopping
        ended = node.wait(timeout=30)
    assert (ended, (marks / "launcher_got").read_text(), (marks / "preempted").exists()) == (143, "SIGTERM\n", True)


GOLDEN = {
    "slurm_torchrun_ddp.sh": dict(nodes=4, gpus=8, time_limit="48:00:00", partition="gpu"),
    "slurm_deepspeed_launcher_requeue.sh": dict(
        nodes=2,
        gpus=8,
        launch={
            "launch_method": "deepspeed",
            "backend": "deepspeed",
            "deepspeed_config": "config/ds_config.json",
            "preflight": True,
        },
        requeue=True,
        signal_seconds=300,
        time_limit="1-00:00:00",
        account="ml",
        modules=("cuda/12.4",),
        conda_env="train",
        mem_per_gpu="64G",
        cpus_per_task=64,
        gpu_request="gpus-per-node",
    ),
    "slurm_torchrun_requeue.sh": dict(
        nodes=2, gpus=8, requeue=True, signal_seconds=600, time_limit="UNLIMITED", cpus_per_task=64
    ),
    "slurm_fsdp_env_venv.sh": dict(
        nodes=2,
        gpus=4,
        launch={
            "backend": "fsdp",
            "fsdp_config": "config/fsdp.json",
            "env": EnvSpec(
                omp_num_threads=8, nccl_debug="INFO", nccl_socket_ifname="ib0", extra=(("HF_HOME", "/scratch/hf"),)
            ),
        },
        venv=".venv",
        exclusive=True,
        extra_sbatch=(("reservation", "big"),),
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden(name):
    kwargs = dict(GOLDEN[name])
    kwargs["launch"] = {**kwargs.get("launch", {}), "workdir": "/home/user/project"}  # what the command writes
    check_golden(name, build_slurm_script(spec(**kwargs), command_line="distsetup slurm ..."))


def grid():
    for method, backend, requeue, preflight, setup, port in itertools.product(
        ("torchrun", "deepspeed", "accelerate"),
        ("ddp", "fsdp", "deepspeed"),
        (False, True),
        (False, True),
        ("venv", "conda", None),
        (None, 29500),
    ):
        yield spec(
            nodes=3,
            gpus=2,
            requeue=requeue,
            time_limit="2:00:00",
            job_name=WEIRD,
            log_output=f"{WEIRD}/%j.out",
            venv=f"{WEIRD}/venv" if setup == "venv" else None,
            conda_env=WEIRD if setup == "conda" else None,
            modules=("cuda/12.4",),
            extra_sbatch=(("comment", WEIRD),),
            launch={
                "launch_method": method,
                "backend": backend,
                "script": f"{WEIRD}/train.py",
                "deepspeed_config": f"{WEIRD}/ds.json" if backend == "deepspeed" else None,
                "fsdp_config": f"{WEIRD}/f.json" if backend == "fsdp" else None,
                **(ACCELERATE_HYBRID_FSDP if (method, backend) == ("accelerate", "fsdp") else {}),
                "preflight": preflight,
                "master_port": port,
                "env": EnvSpec(2, "INFO", None, True, 30, 1, (("W", WEIRD),)),
                "workdir": f"/{WEIRD}" if port else None,
            },
        )


def test_shellcheck_grid_and_per_node_programs(tmp_path):
    """Each of the grid's 216 jobs, its node program apart (20 different ones, each checked as a script of its own):
    the job's shell around the program's quotes differs in 108 ways, each checked once with one of its programs in
    place. Inside single quotes a program is one word to shellcheck, as long as no quote of its own ends them."""
    jobs = [build_slurm_script(s, command_line=f"distsetup slurm --job_name '{WEIRD}'") for s in grid()]
    assert len(set(jobs)) == 216
    node_programs, job_shells = set(), {}
    for job in jobs:
        program = srun_program(job)
        assert "'" not in program
        node_programs.add(program)
        job_shells.setdefault(job_shell(job), job)
    assert len(node_programs) > 10 and len(job_shells) > 50
    paths = []
    for i, content in enumerate([*job_shells.values(), *sorted(node_programs)]):
        paths.append(tmp_path / f"script_{i}.sh")
        paths[-1].write_text(content)
    shellcheck(paths)


def test_shellcheck_golden_files():
    shellcheck(sorted(GOLDEN_DIR.glob("slurm_*.sh")))

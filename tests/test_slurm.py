"""`distsetup slurm`: #SBATCH mapping, validation, golden scripts, shellcheck, and a real two-node SLURM cluster."""

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden_files import check_golden
from shell_checks import shellcheck, srun_program

from distsetup.errors import DistsetupError
from distsetup.scripts.launch_plan import EnvSpec, LaunchSpec
from distsetup.scripts.sbatch import (
    MANAGED_SBATCH_KEYS,
    SlurmSpec,
    build_slurm_script,
    parse_sbatch_pairs,
    sbatch_directives,
    sbatch_quote,
    shutdown_grace_seconds,
    time_limit_seconds,
)

VENV = Path(sys.executable).parent.parent
WEIRD = "we ird 'dir\" $x"


def spec(nodes=2, gpus=4, launch=None, **kwargs) -> SlurmSpec:
    launch = launch or {}
    launch.setdefault("rdzv_backend", "c10d" if launch.get("launch_method", "torchrun") == "torchrun" else "static")
    return SlurmSpec(launch=LaunchSpec(num_nodes=nodes, nproc_per_node=gpus, config="config.yaml", **launch), **kwargs)


def build(**kwargs) -> str:
    return build_slurm_script(spec(**kwargs), command_line="distsetup slurm ...")


# --- the #SBATCH mapping -------------------------------------------------------------------------


def test_directives_are_sorted_and_complete():
    d = sbatch_directives(
        spec(
            cpus_per_task=32,
            mem="256G",
            time_limit="48:00:00",
            partition="gpu",
            account="ml",
            qos="high",
            constraint="a100&ib",
            exclusive=True,
            log_error="%x-%j.err",
            mail_user="me@example.org",
            mail_type="END,FAIL",
        )
    )
    assert list(d) == sorted(d)
    assert d == {
        "account": "ml",
        "constraint": "a100&ib",
        "cpus-per-task": "32",
        "error": "%x-%j.err",
        "exclusive": None,
        "gres": "gpu:4",
        "job-name": "distsetup",
        "mail-type": "END,FAIL",
        "mail-user": "me@example.org",
        "mem": "256G",
        "nodes": "2",
        "ntasks-per-node": "1",
        "output": "%x-%j.out",
        "partition": "gpu",
        "qos": "high",
        "time": "48:00:00",
    }


def test_gpu_request_styles():
    assert sbatch_directives(spec(gpu_type="a100"))["gres"] == "gpu:a100:4"
    d = sbatch_directives(spec(gpu_request="gpus-per-node"))
    assert d["gpus-per-node"] == "4" and "gres" not in d
    assert not {"gres", "gpus-per-node"} & set(sbatch_directives(spec(gpu_request="none")))


def test_extra_sbatch_pairs_and_flags():
    pairs = parse_sbatch_pairs(["reservation=big", "--nice=10", "overcommit"])
    d = sbatch_directives(spec(extra_sbatch=pairs))
    assert d["reservation"] == "big" and d["nice"] == "10" and d["overcommit"] is None
    with pytest.raises(DistsetupError, match="not KEY=VALUE"):
        parse_sbatch_pairs(["Bad Key=1"])


@pytest.mark.parametrize(
    "item, flag",
    [
        ("nodes=3", "--num_nodes"),
        ("ntasks-per-node=8", "--num_gpus_per_node"),
        ("gres=gpu:2", "--num_gpus_per_node"),
        ("gpus-per-node=2", "--gpu_request"),
        ("signal=B:USR1@60", "--signal_seconds"),
        ("time=10", "--time_limit"),
        ("requeue", "--requeue"),
        ("job-name=x", "--job_name"),
    ],
)
def test_sbatch_pairs_cannot_override_what_distsetup_writes(item, flag):
    """Bug: --num_nodes 2 --sbatch nodes=3 wrote --nodes=3 silently (one world of 2 nodes on 3)."""
    with pytest.raises(DistsetupError, match=f"distsetup writes #SBATCH --{item.split('=')[0]} itself.*{flag}"):
        build(extra_sbatch=parse_sbatch_pairs([item]))
    assert set(MANAGED_SBATCH_KEYS) >= {
        k for k in sbatch_directives(spec(requeue=True, exclusive=True, mem="1G")) if k != "open-mode"
    }


def test_requeue_lines():
    d = sbatch_directives(spec(requeue=True, signal_seconds=300))
    assert d["requeue"] is None and d["signal"] == "B:USR1@300" and d["open-mode"] == "append"


GRACE = re.compile(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+) ", re.M)


@pytest.mark.parametrize("signal_seconds, grace", [(300, 270), (120, 90), (60, 30), (20, 10)])
def test_requeue_gives_torchrun_a_grace_period_from_signal_seconds(signal_seconds, grace):
    """Bug: torchrun SIGKILLs its workers 30 s after SIGTERM by default, mid-way through a big checkpoint."""
    assert shutdown_grace_seconds(signal_seconds) == grace
    for method in ("torchrun", "accelerate"):
        text = build(requeue=True, signal_seconds=signal_seconds, launch={"launch_method": method})
        assert [int(v) for v in GRACE.findall(text)] == [grace]
    assert not GRACE.search(build())


def test_deepspeed_launcher_header_says_its_limits():
    text = build(
        requeue=True, launch={"launch_method": "deepspeed", "backend": "deepspeed", "deepspeed_config": "ds.json"}
    )
    assert "SIGKILLs the training processes 30 s after SIGTERM" in text and not GRACE.search(text)
    assert "uses local GPU ids 0..N-1" in text and "uses local GPU ids" not in build()


def test_sbatch_quote():
    assert sbatch_quote("%x-%j.out") == "%x-%j.out"
    assert sbatch_quote('my "job" \\ x') == '"my \\"job\\" \\\\ x"'


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 5400),
        ("05:30", 330),
        ("48:00:00", 172800),
        ("2-12", 216000),
        ("1-02:30", 95400),
        ("1-00:00:01", 86401),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_time_limits_slurm_accepts(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "1:2:3:4", "1h", "2-25", "10:75", "1-2:3:4:5", "-5", "1.5", "00:00:00"])
def test_time_limits_slurm_rejects(text):
    with pytest.raises(DistsetupError, match="not one SLURM accepts"):
        time_limit_seconds(text)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nodes": 0}, "--num_nodes 0 must be at least 1"),
        ({"gpus": 0}, "--num_gpus_per_node 0 must be at least 1"),
        ({"time_limit": "48h"}, "not one SLURM accepts"),
        ({"partition": "gpu queue"}, "not a SLURM partition name"),
        ({"partition": "gpu;rm"}, "not a SLURM partition name"),
        ({"mem": "lots"}, "not a SLURM memory size"),
        ({"mem": "1G", "mem_per_gpu": "1G"}, "mutually exclusive"),
        ({"conda_env": "a", "venv": "b"}, "mutually exclusive"),
        ({"modules": ("cuda 12",)}, "not an environment-module name"),
        ({"mail_type": "SOMETIMES"}, "not a SLURM mail type"),
        ({"requeue": True, "time_limit": "1", "signal_seconds": 120}, "not shorter than the time limit"),
        ({"job_name": "a\nb"}, "control character"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(DistsetupError, match=message):
        build(**kwargs)


def test_unlimited_time_with_requeue():
    assert "#SBATCH --time=UNLIMITED" in build(time_limit="UNLIMITED", requeue=True)


# --- the script ----------------------------------------------------------------------------------


def test_one_world_across_nodes_with_per_node_values_expanding_on_each_node():
    text = build()
    program = srun_program(text)
    assert 'srun "${SRUN_ARGS[@]}" bash -c \'' in text
    assert "--ntasks-per-node=1" in text
    assert 'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in text
    assert 'export MASTER_ADDR="${HOSTS[0]:?' in text
    assert 'export MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"' in text
    assert 'NODE_RANK="$SLURM_NODEID"' in program  # inside the single quotes: expands per node
    outside = text.replace(program[len("#!/bin/bash\n") :], "")
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
    assert "source 'we ird '\"'\"'dir\" $x/.venv'/bin/activate" in text
    assert "export WANDB_MODE=offline" in text
    assert "conda activate 'my env'" in build(conda_env="my env")


def test_job_enters_the_folder_it_was_written_in_before_anything_else():
    """Issue 11: `cd jobs && sbatch ../scripts/slurm_job.sh` failed on every node (can't open file
    '.../jobs/src/train.py'): SLURM runs the batch script in the submit folder. The script now enters the
    folder distsetup ran in before the set-up lines (a relative --venv means the same) and on every node."""
    text = build(venv=".venv", modules=("cuda/12.4",), launch={"workdir": f"/{WEIRD}"})
    assert "export WORKDIR='/we ird '\"'\"'dir\" $x'" in text
    assert text.index('cd "$WORKDIR" ||') < text.index("module load") < text.index("source .venv/bin/activate")
    assert 'cd "$WORKDIR"' in srun_program(text)
    assert "MODULE=distsetup.train" in text and 'exec "${LAUNCH[@]}" -m "$MODULE" "$@"' in srun_program(text)


def test_requeue_trap_forwards_term_and_requeues():
    text = build(requeue=True)
    assert "trap forward_preemption USR1" in text
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert text.rstrip().endswith('wait "$SRUN_PID"')
    assert 'exec "${LAUNCH[@]}"' in srun_program(text)  # the launcher itself receives the TERM


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
                "preflight": preflight,
                "master_port": port,
                "env": EnvSpec(2, "INFO", None, True, 30, 1, (("W", WEIRD),)),
                "workdir": f"/{WEIRD}" if port else None,
            },
        )


def test_shellcheck_grid_and_per_node_programs(tmp_path):
    paths = []
    for i, s in enumerate(grid()):
        text = build_slurm_script(s, command_line=f"distsetup slurm --job_name '{WEIRD}'")
        for name, content in ((f"job_{i}.sh", text), (f"node_{i}.sh", srun_program(text))):
            path = tmp_path / name
            path.write_text(content)
            paths.append(path)
    assert len(paths) == 2 * 216
    shellcheck(paths)


def test_shellcheck_golden_files():
    shellcheck(sorted(Path(__file__).parent.joinpath("golden").glob("slurm_*.sh")))


# --- the command ---------------------------------------------------------------------------------


def test_command_writes_the_script(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(
        "slurm",
        "--num-nodes",
        "4",
        "--num_gpus_per_node",
        "8",
        "--time_limit",
        "48:00:00",
        "--partition",
        "gpu",
        "--env_module",
        "cuda/12.4",
        "--env-module",
        "nccl",
        "--env",
        "A=1",
        "--sbatch",
        "reservation=big",
        "--requeue",
    )
    assert result.exit_code == 0, result.output
    script = tmp_path / "scripts" / "slurm_job.sh"
    text = script.read_text()
    assert os.access(script, os.X_OK)
    assert "Next: sbatch scripts/slurm_job.sh" in result.stderr
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --reservation=big",
        "module load nccl",
        "export A=1",
        f"export WORKDIR={tmp_path}",
    ):
        assert line in text
    assert "deprecated" not in result.stderr


def test_old_module_flag_still_loads_environment_modules(run_cli, tmp_path, monkeypatch):
    """Issue 11: `slurm --module` (environment module) is now --env_module, the Python module is --python_module
    as in `launcher`; --module keeps its meaning for one release, with one line naming the new flag."""
    monkeypatch.chdir(tmp_path)
    result = run_cli(
        "slurm",
        "--num_gpus_per_node",
        "2",
        "--cpus_per_task",
        "2",
        "--module",
        "cuda/12.4",
        "--module",
        "nccl",
        "--python_module",
        "pkg.train",
        "-o",
        "job.sh",
    )
    assert result.exit_code == 0, result.output
    text = (tmp_path / "job.sh").read_text()
    assert "module load cuda/12.4\nmodule load nccl\n" in text and "export MODULE=pkg.train" in text
    assert "--env_module cuda/12.4 --env_module nccl" in text.splitlines()[2]
    assert [line for line in result.stderr.splitlines() if "deprecated" in line] == [
        "Warning: `slurm --module` is deprecated and goes in the next release: use --env_module (same meaning)."
    ]
    both = run_cli("slurm", "--module", "a", "--env_module", "b", "-o", "-")
    assert both.exit_code != 0 and "give one of them" in both.output
    bad = run_cli("slurm", "--env_module", "cuda 12", "-o", "-")
    assert bad.exit_code != 0 and "--env_module 'cuda 12' is not an environment-module name" in bad.output
    help_text = run_cli("slurm", "--help").stdout
    assert "--env_module" in help_text and "--python_module" in help_text and "--module " not in help_text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_nodes", "0"], "--num_nodes 0 must be at least 1"),
        (["--num_gpus_per_node", "0"], "--num_gpus_per_node 0 must be at least 1"),
        (["--num_gpus_per_node", "auto"], "needs a number"),
        (["--time_limit", "3 days"], "not one SLURM accepts"),
        (["--partition", "a b"], "not a SLURM partition name"),
        (["--env", "1X=2"], "not KEY=VALUE"),
        (
            ["--use_deepspeed", "--deepspeed_config", "ds.json", "--num_nodes", "2", "--num_gpus_per_node", "2"],
            "6 is not divisible by train_micro_batch_size_per_gpu 3 x world size 4",
        ),
    ],
)
def test_command_bad_input_writes_nothing(run_cli, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 3}))
    result = run_cli("slurm", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "scripts").exists()


def test_sbatch_option_of_a_flag_is_refused(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli("slurm", "--num_nodes", "2", "--num_gpus_per_node", "2", "--sbatch", "nodes=3")
    assert result.exit_code != 0 and "HINT: use --num_nodes" in result.output
    assert not (tmp_path / "scripts").exists()


@pytest.mark.parametrize("args, warned", [([], True), (["--cpus_per_task", "16"], False), (["--exclusive"], False)])
def test_warns_about_one_cpu_per_node(run_cli, tmp_path, monkeypatch, args, warned):
    """Bug: without --cpus_per_task SLURM may give each node's one task 1 CPU for all its processes."""
    monkeypatch.chdir(tmp_path)
    result = run_cli("slurm", "--num_gpus_per_node", "2", "-o", "-", *args)
    assert result.exit_code == 0, result.output
    assert ("--cpus_per_task 16 (8 per GPU)" in result.stderr) == warned


def test_submit_prints_the_job_id(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text('#!/bin/bash\n[[ "$1" == --parsable && -f "$2" ]] && echo "4242;cluster"\n')
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    result = run_cli("slurm", "--num_gpus_per_node", "2", "--submit")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "4242"
    assert run_cli("slurm", "--submit", "--dry_run").exit_code != 0


@pytest.mark.slow
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


def submit(run_cli, cluster, root: Path, *args) -> str:
    """A two-node job running distsetup's trainer (python -m distsetup.train), submitted from `root`."""
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
    return cluster.run("sbatch", "--parsable", str(script), cwd=root).stdout.strip().split(";")[0]


def job_log(root: Path, job_id: str, name: str = "distsetup") -> str:
    return (root / f"{name}-{job_id}.out").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["deepspeed"])
def test_two_node_job_is_one_world(run_cli, cluster, tmp_path, method):
    """The deepspeed launcher here; torchrun's two-node job is the one `distsetup init` writes (tests/test_init.py),
    in a folder whose name needs quoting, as this one."""
    root = slurm_project(tmp_path / WEIRD, max_steps=6, checkpoint_interval=3)
    ds = root / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 1},
            }
        )
    )
    backend = ["--use_deepspeed", "--deepspeed_config", ds] if method == "deepspeed" else []
    job = submit(
        run_cli,
        cluster,
        root,
        "--preflight",
        "--job_name",
        'two "nodes"',  # sbatch reads the quoting
        "--launch_method",
        method,
        *backend,
    )
    state = cluster.wait_job(job, timeout=150)
    log = job_log(root, job, name='two "nodes"')
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert state["NodeList"] == "n[1-2]"
    assert "node n1: node_rank 0 of 2" in log and "node n2: node_rank 1 of 2" in log
    assert "preflight OK: 2 ranks" in log
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["backend"] == ("deepspeed" if method == "deepspeed" else "ddp")
    assert (root / "out" / "checkpoints" / "step_0000006" / "COMPLETE").exists()


@pytest.mark.slow
def test_job_submitted_from_another_folder_trains(run_cli, cluster, tmp_path, monkeypatch):
    """Issue 11's proof for SLURM: written in the project with relative paths, submitted as
    `cd jobs && sbatch ../scripts/slurm_job.sh`; it failed on every node (can't open file .../jobs/src/train.py)."""
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
    job = cluster.run("sbatch", "--parsable", "../project/scripts/slurm_job.sh", cwd=jobs).stdout.split(";")[0].strip()
    state = cluster.wait_job(job, timeout=150)
    log = job_log(jobs, job)  # SLURM writes the log where sbatch ran
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert "node n1: node_rank 0 of 2" in log and "node n2: node_rank 1 of 2" in log
    summary = json.loads((root / "out" / "summary.json").read_text())  # output_dir: relative to the project
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert not (jobs / "out").exists()


@pytest.mark.slow
def test_requeue_checkpoints_and_resumes(run_cli, cluster, tmp_path):
    root = slurm_project(tmp_path / "requeue", max_steps=200, checkpoint_interval=5)
    job = submit(run_cli, cluster, root, "--requeue", "--signal_seconds", 60)
    checkpoints = root / "out" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints / "step_0000005" / "COMPLETE").exists():  # training is under way
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    # What SLURM does before the time limit (--signal=B:USR1@60): signal the batch shell.
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    state = cluster.wait_job(job, timeout=200)
    log = job_log(root, job)
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert state["Restarts"] == "1", log[-4000:]
    preempted = [line for line in log.splitlines() if line.startswith("preempted: checkpoint at step ")]
    assert len(preempted) == 1, log[-4000:]
    step = int(preempted[0].rsplit(" ", 1)[1])
    assert 5 <= step < 200
    assert (checkpoints / f"step_{step:07d}" / "COMPLETE").exists()
    assert "distsetup: requeueing job" in log
    assert f"resumed from {checkpoints / f'step_{step:07d}'} (step {step})" in log
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["world_size"] == 2


def test_no_config_is_no_warning_and_the_next_step_names_the_command_that_runs_the_script(run_cli, tmp_path):
    """The trainer runs on its defaults without --config (the wheel test trains so), so nothing warns."""
    for command, runner, extra in (
        ("launcher", "bash", []),
        ("slurm", "sbatch", ["--time_limit", "1:00:00", "--cpus_per_task", "8"]),
    ):
        out = tmp_path / f"my {command}.sh"
        result = run_cli(command, "--num_gpus_per_node", "2", *extra, "-o", out)
        assert result.exit_code == 0, result.output
        assert "Warning" not in result.stderr and "--config" not in result.stderr
        assert f"Next: {runner} '{out}'" in result.stderr

"""`distsetup launcher`, for real: generated scripts train on CPU with 2 processes, on one node or two."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_inputs import DS_CONFIG, WEIRD
from repo import REPO, free_port
from shell_checks import run_script

VENV_BIN = Path(sys.executable).parent


def write_project(root: Path, max_steps: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ds.json").write_text(json.dumps(DS_CONFIG))
    (root / "config.yaml").write_text(f"""\
model: {{n_layer: 1, n_head: 2, n_embd: 32, block_size: 16}}
data: {{num_samples: 256}}
training: {{max_steps: {max_steps}, warmup_steps: 1, checkpoint_interval: 2, log_interval: 2, micro_batch_size: 4,
           output_dir: {json.dumps(str(root / "out"))}}}
distributed: {{backend: ddp}}
""")
    return root


def run_env() -> dict:
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions")),
    }


def generate(run_cli, root: Path, *args, out_name: str = "run.sh") -> Path:
    """A launch script for distsetup's trainer (python -m distsetup.train, the default)."""
    out = root / out_name
    result = run_cli("launcher", "--config", root / "config.yaml", "-o", out, *args)
    assert result.exit_code == 0, result.output
    return out


def assert_trained(root: Path, result, backend: str, steps: int = 4):
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"], summary["backend"]) == (2, steps, backend), summary
    assert list((root / "out" / "checkpoints").glob(f"step_{steps:07d}/COMPLETE")), "no final checkpoint"
    return log


@pytest.mark.parametrize(
    "backend_args, method, backend",
    [
        (["--preflight"], "torchrun", "fsdp"),  # the run config edited to fsdp after the script was written
        (["--use_fsdp"], "torchrun", "fsdp"),
        (["--use_deepspeed", "--deepspeed_config", "DS"], "torchrun", "deepspeed"),
        (["--use_deepspeed", "--deepspeed_config", "DS"], "deepspeed", "deepspeed"),
        ([], "accelerate", "ddp"),
    ],
    ids=["torchrun-edited-preflight", "torchrun-fsdp", "torchrun-deepspeed", "deepspeed-launcher", "accelerate-ddp"],
)
def test_single_node_script_trains(run_cli, tmp_path, backend_args, method, backend):
    """On a free port, whichever launcher: 29500, the launchers' default, may be another run's (the tests of
    Kubernetes pods use it meanwhile)."""
    root = write_project(tmp_path / WEIRD)  # the real run goes through the weird folder too
    args = [str(root / "ds.json") if a == "DS" else a for a in backend_args]
    script = generate(run_cli, root, "--num_gpus_per_node", "2", "--launch_method", method, *args)
    if not backend_args or backend_args == ["--preflight"]:  # the run config's own backend: read when the run starts
        config = root / "config.yaml"  # (a script that passed distributed.backend=ddp trained DDP after this edit)
        config.write_text(config.read_text().replace("backend: ddp", f"backend: {backend}"))
    result = subprocess.run(["bash", str(script)], cwd=root, env=run_env(), capture_output=True, text=True, timeout=400)
    log = assert_trained(root, result, backend)
    assert "no GPUs found: starting 2 CPU process(es) per node" in log
    if method == "deepspeed":  # the port the script found, which the launcher passes on
        ports = re.findall(r"--master_port=(\d+)", log)
        assert ports and "--master_port=29500" not in log, log[-3000:]
        # the launcher sets LOCAL_SIZE, which would map DeepSpeed's shared-memory all-reduce: no step uses it
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{ports[0]}_*"))
    if "--preflight" in backend_args:
        assert "preflight OK: 2 ranks" in log


def session_processes(session: int) -> list[int]:
    """The processes still in `session` (the launch script's, started with a session of its own)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    alive.append(int(entry.name))
            except OSError:  # gone meanwhile
                pass
    return alive


@pytest.mark.parametrize("when", ["training", "starting"])
def test_sigterm_to_a_deepspeed_launcher_script_checkpoints_and_leaves_no_process(run_cli, tmp_path, when):
    """`kill PID` of the script, as a supervisor sends it: its deepspeed launcher (runner.py) died of it and left its
    launch.py and the ranks training, holding the run's lock; now the ranks checkpoint (once training) and every
    process ends, also when the signal comes while the launcher is still starting its launch.py."""
    root = write_project(tmp_path / "preempted", max_steps=100000)
    script = generate(
        run_cli,
        root,
        "--num_gpus_per_node",
        "2",
        "--launch_method",
        "deepspeed",
        "--use_deepspeed",
        "--deepspeed_config",
        root / "ds.json",
    )
    log = root / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(script)], cwd=root, env=run_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while when == "training" and not (root / "out" / "checkpoints" / "step_0000002" / "COMPLETE").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        while when == "starting" and "cmd = " not in log.read_text():  # the runner is up; its launch.py is not yet
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)  # the script's process alone
        proc.wait(timeout=120)  # not the 100000 steps (a signal lost while starting)
        deadline = time.monotonic() + 60
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_processes(proc.pid) == [], log.read_text()[-3000:]
        # stopped before it trained, or checkpointed: never the 0 of a finished run (a supervisor reads it so)
        assert proc.returncode not in (0, None), log.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if when == "training":
        stopped = re.search(r"preempted: checkpoint at step (\d+)", log.read_text())
        assert stopped, log.read_text()[-3000:]
        assert (root / "out" / "checkpoints" / f"step_{int(stopped.group(1)):07d}" / "COMPLETE").exists()


def test_fsdp_file_named_as_yaml_would_misread_it_trains(run_cli, tmp_path):
    """An FSDP file whose name YAML would misread reaches 2 real processes, its own setting (a full state dict) too."""
    root = write_project(tmp_path / WEIRD)
    name = "@f [s] a: b #c 'q\" yes.json"
    (root / name).write_text(
        json.dumps(
            {"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_state_dict_type": "FULL_STATE_DICT"}
        )
    )
    script = generate(
        run_cli,
        root,
        "--num_gpus_per_node",
        "2",
        "--use_fsdp",
        "--fsdp_config",
        root / name,
        "--master_port",
        free_port(),
    )
    result = subprocess.run(["bash", str(script)], cwd=root, env=run_env(), capture_output=True, text=True, timeout=400)
    assert_trained(root, result, "fsdp")
    final = root / "out" / "checkpoints" / "step_0000004"
    assert (final / "full_state.pt").exists(), sorted(p.name for p in final.iterdir())


@pytest.mark.parametrize("method", ["torchrun", "deepspeed"])
def test_two_node_scripts_form_one_world(run_cli, tmp_path, method):
    root = write_project(tmp_path / "two nodes")
    port = free_port()
    backend = ["--use_deepspeed", "--deepspeed_config", root / "ds.json"] if method == "deepspeed" else []
    scripts = [
        generate(
            run_cli,
            root,
            "--num_nodes",
            2,
            "--num_gpus_per_node",
            1,
            "--node_rank",
            rank,
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "--launch_method",
            method,
            *backend,
            out_name=f"node{rank}.sh",
        )
        for rank in (0, 1)
    ]
    procs = [
        subprocess.Popen(
            ["bash", str(s)], cwd=root, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for s in scripts
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out[-4000:]
        assert f"node {rank} of 2" in out
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


# A user's own Accelerate program: each process writes what its Accelerator made of the world, and its weights.
ACCELERATE_PROGRAM = """\
import json
import os
import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # one ZeRO takes as it is
inputs = torch.randn(64, 4)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, inputs.sum(-1, keepdim=True)), batch_size=8)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
batches = 0
for x, y in data:
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    batches += 1
seen = {"processes": accelerator.num_processes, "type": str(accelerator.distributed_type), "batches": batches}
seen["world"] = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
seen.update(wrapped=type(model).__name__, weights=accelerator.unwrap_model(model).weight.tolist(), argv=sys.argv[2:])
if (mesh := accelerator.parallelism_config) is not None:
    seen["replicas"], seen["shards"] = mesh.dp_replicate_size, mesh.dp_shard_size
with open(f"{sys.argv[1]}/process{os.environ['RANK']}.json", "w") as f:  # the world's rank, whoever formed it
    json.dump(seen, f)
# as Accelerate's examples end: a DeepSpeed world on the CPU left to the interpreter's exit let a rank die there now
# and then, and the other node's torchrun then waited out its exit barrier (300 s)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
"""


def test_a_users_accelerate_program_trains_cpu_processes_as_one_world(run_cli, tmp_path, monkeypatch):
    """Without a GPU, Accelerate forms a world of CPU processes only when told to (ACCELERATE_USE_CPU): the script
    tells it, so the program's Accelerator trains 2 CPU processes as one DDP world (each takes half the batches and
    the weights agree), not as two worlds of one. Accelerate applies FSDP to GPU processes only: the script says so.
    So the 2-D mesh a HYBRID_SHARD file gets on GPUs is not given here either: Accelerator() refuses one for CPU
    processes (the next test: what it is on GPUs)."""
    (tmp_path / "own_train.py").write_text(ACCELERATE_PROGRAM)
    monkeypatch.chdir(tmp_path)  # the script's folder, where it starts the program
    script = tmp_path / "run.sh"
    assert run_cli("fsdp", "--sharding_strategy", "HYBRID_SHARD", "-o", "fsdp.json").exit_code == 0
    generated = run_cli(
        "launcher", "--script", "own_train.py", "--launch_method", "accelerate", "--use_fsdp", "--fsdp_config",
        "fsdp.json", "--num_gpus_per_node", 2, "--master_port", free_port(), "-o", script,
    )  # fmt: skip
    assert generated.exit_code == 0, generated.output
    env = {**run_env(), "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on any machine
    result = subprocess.run(
        ["bash", str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Accelerate applies FSDP to GPU processes only" in result.stderr
    seen = [json.loads((tmp_path / f"process{index}.json").read_text()) for index in (0, 1)]
    for process in seen:
        assert process["processes"] == process["world"] == 2 and process["type"] == "DistributedType.MULTI_CPU", process
        assert process["wrapped"] == "DistributedDataParallel" and process["batches"] == 4, process
        assert "replicas" not in process, process
    assert seen[0]["weights"] == seen[1]["weights"]


def test_accelerate_launch_takes_hybrid_sharding_as_its_mesh_and_the_gpus_the_environment_shows(
    run_cli, tmp_path, monkeypatch
):
    """What the script of a HYBRID_SHARD file hands accelerate launch on GPUs (node 1 of 3, 2 processes each), read
    by accelerate's own parser, checks and environment, beside a default config (as `accelerate config` writes it)
    naming other GPUs, then by the ParallelismConfig an Accelerator makes from it: the nodes replicate, each node's
    processes shard, the world whole (Accelerator() checks that). Bug: the processes got the default config's
    gpu_ids as CUDA_VISIBLE_DEVICES, whatever --gpus or the scheduler had chosen."""
    import accelerate.commands.config.config_args
    import accelerate.commands.launch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_multi_gpu_env

    monkeypatch.chdir(tmp_path)
    default = tmp_path / "default_config.yaml"  # where accelerate found it when imported ($HF_HOME/accelerate)
    default.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\ngpu_ids: 0,1\n")
    for module in (accelerate.commands.launch, accelerate.commands.config.config_args):
        monkeypatch.setattr(module, "default_config_file", str(default))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the node's GPUs, as --gpus or a scheduler chose them
    (tmp_path / "mine.py").write_text("")
    assert run_cli("fsdp", "--sharding_strategy", "HYBRID_SHARD", "-o", "fsdp.json").exit_code == 0
    written = run_cli(
        "launcher", "--launch_method", "accelerate", "--script", "mine.py", "--use_fsdp", "--fsdp_config", "fsdp.json",
        "--num_nodes", 3, "--num_gpus_per_node", 2, "--master_addr", "10.0.0.1", "--node_rank", 1, "-o", "run.sh",
    )  # fmt: skip
    assert written.exit_code == 0, written.output
    run = run_script(tmp_path / "run.sh", tmp_path, "accelerate", env={"ACCELERATE_USE_CPU": "false"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    argv = run.stdout.splitlines()
    args = launch_command_parser().parse_args(argv[argv.index("launch") + 1 :])
    args, _, _ = _validate_launch_command(args)
    environment = prepare_multi_gpu_env(args)
    assert environment["CUDA_VISIBLE_DEVICES"] == "2,3"
    for name, value in environment.items():
        if name.startswith(("PARALLELISM_CONFIG_", "ACCELERATE_USE_")):
            monkeypatch.setenv(name, value)
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"  # what makes Accelerator() build one
    mesh = ParallelismConfig()
    assert (mesh.dp_replicate_size, mesh.dp_shard_size, mesh.total_size) == (3, 2, args.num_processes) == (3, 2, 6)
    assert mesh.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]


def test_a_users_accelerate_program_gets_the_deepspeed_file_from_accelerate_beside_a_default_config(
    run_cli, tmp_path, monkeypatch
):
    """Bugs: the program was handed `--deepspeed FILE`, which its parser refuses; accelerate launch took the
    precision of its default config (which every `accelerate config` writes), then refused the DeepSpeed file in
    every rank; and on two nodes accelerate started the deepspeed launcher with pdsh and no hostfile, so each node
    trained alone and node 0 exited 0. Here two nodes of one process each (on loopback) form one DeepSpeed world on
    the CPU (ACCELERATE_USE_CPU=false, as the script's warning says), with the file's ZeRO stage (whose batch holds
    only in a world of 2), its weights alike on both ranks."""
    (tmp_path / "own_train.py").write_text(ACCELERATE_PROGRAM)
    monkeypatch.chdir(tmp_path)
    made = run_cli(
        "deepspeed", "--zero_stage", 2, "--micro_batch_size", 8, "--world_size", 2, "--optimizer", "none",
        "-o", "ds.json",
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    generated = run_cli(
        "launcher", "--script", "own_train.py", "--launch_method", "accelerate", "--use_deepspeed",
        "--deepspeed_config", "ds.json", "--num_nodes", 2, "--num_gpus_per_node", 1, "--master_addr", "127.0.0.1",
        "--master_port", free_port(), "-o", "run.sh",
    )  # fmt: skip
    assert generated.exit_code == 0, generated.output
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"  # as `accelerate config` writes it
    default.parent.mkdir(parents=True)
    default.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\n")
    env = {**run_env(), "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "false", "HF_HOME": str(tmp_path / "hf")}
    nodes = [
        subprocess.Popen(
            ["bash", "run.sh", str(tmp_path)],
            cwd=tmp_path,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-4000:]
    seen = [json.loads((tmp_path / f"process{index}.json").read_text()) for index in (0, 1)]
    for process in seen:
        # one world over both nodes (Accelerate's own count, on CPUs without use_cpu, stays 1: no data sharding)
        assert process["world"] == 2 and process["type"] == "DistributedType.DEEPSPEED", process
        assert process["wrapped"] == "DeepSpeedEngine", process
        assert process["argv"] == [], process  # nothing but its own arguments
    assert seen[0]["weights"] == seen[1]["weights"]

"""`distsetup launcher`: the pure builder, golden scripts, shellcheck over a grid, bad input, real CPU runs."""

import itertools
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from distsetup.errors import DistsetupError
from distsetup.launch_plan import EnvSpec, LaunchSpec, build_launcher_script, hostfile_lines, parse_gpus
from golden_files import check_golden
from shell_checks import shellcheck

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "src" / "train.py"
VENV_BIN = Path(sys.executable).parent
WEIRD = "we ird 'dir\" $x"   # spaces, both quotes and a dollar: every path must survive quoting
DS_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 1}, "steps_per_print": 100}


def build(**kwargs) -> str:
    return build_launcher_script(LaunchSpec(**kwargs), command_line="distsetup launcher ...")


# --- the builder ---------------------------------------------------------------------------------

def test_script_shape_header_sections_and_passthrough():
    text = build(config="config.yaml", nproc_per_node=4)
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines
    headers = [line for line in lines if line.startswith("# --- ")]
    assert headers == ["# --- parameters ---", "# --- environment ---", "# --- command ---"]
    assert "1 node(s) x 4 process(es) per node = 4 process(es)" in text
    assert 'exec "${LAUNCH[@]}" "$SCRIPT" "$@"' in text
    assert 'set -- "${TRAIN_ARGS[@]}" "$@"' in text
    assert "TRAIN_ARGS=(--config config.yaml distributed.backend=ddp)" in text


def test_single_node_torchrun_is_standalone_unless_a_port_is_given():
    assert "LAUNCH+=(--standalone)" in build(nproc_per_node=2)
    text = build(nproc_per_node=2, master_port=29555)
    assert "--standalone" not in text and "MASTER_PORT=29555" in text
    assert '--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"' in text


def test_multinode_node_rank_given_or_read_at_run_time():
    assert 'NODE_RANK="${NODE_RANK:-1}"' in build(num_nodes=2, nproc_per_node=8, node_rank=1)
    assert 'NODE_RANK="${NODE_RANK:?' in build(num_nodes=2, nproc_per_node=8)


def test_c10d_rendezvous():
    text = build(num_nodes=4, nproc_per_node=8, rdzv_backend="c10d", rdzv_id="job 7")
    assert '--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID"' in text
    assert "RDZV_ID='job 7'" in text


def test_deepspeed_backend_passes_its_file_to_train_py():
    text = build(backend="deepspeed", deepspeed_config="ds config.json", nproc_per_node=2)
    assert "TRAIN_ARGS=(distributed.backend=deepspeed --deepspeed 'ds config.json')" in text


def test_fsdp_backend_and_a_users_script_gets_no_overrides():
    assert "distributed.fsdp_config=fsdp.json" in build(backend="fsdp", fsdp_config="fsdp.json", nproc_per_node=2)
    text = build(backend="deepspeed", deepspeed_config="ds.json", script="mine.py", config="c.yaml")
    assert "TRAIN_ARGS=(--config c.yaml --deepspeed ds.json)" in text


def test_module_target_per_launcher():
    assert 'exec "${LAUNCH[@]}" -m "$MODULE" "$@"' in build(script=None, module="pkg.train")
    text = build(script=None, module="pkg.train", launch_method="deepspeed", nproc_per_node=2)
    assert 'exec "${LAUNCH[@]}" --module "$MODULE" "$@"' in text


def test_deepspeed_launcher_single_and_multi_node():
    single = build(launch_method="deepspeed", nproc_per_node=2)
    assert 'LAUNCH+=(--num_gpus "$NPROC_PER_NODE")' in single and "--hostfile" not in single
    multi = build(launch_method="deepspeed", num_nodes=2, nproc_per_node=4, node_rank=0, hosts=("g1", "g2"))
    assert "--no_ssh --node_rank \"$NODE_RANK\"" in multi
    assert "printf '%s\\n' 'g1 slots=4' 'g2 slots=4' >\"$HOSTFILE\"" in multi
    pdsh = build(launch_method="deepspeed", num_nodes=2, nproc_per_node=4, hosts=("g1", "g2"), ssh=True)
    assert "--launcher pdsh" in pdsh and "--no_ssh" not in pdsh


def test_hostfile_lines():
    assert hostfile_lines(("a", "b"), 8) == ["a slots=8", "b slots=8"]


def test_gpus_and_auto_count():
    text = build(gpus=(2, 3), nproc_per_node=2)
    assert "export CUDA_VISIBLE_DEVICES=2,3" in text
    auto = build()
    assert "NPROC_PER_NODE=auto" in auto and 'NPROC_PER_NODE="$GPUS_FOUND"' in auto


def test_cpu_processes_are_announced():
    assert "no GPUs found: starting $NPROC_PER_NODE CPU process(es)" in build(nproc_per_node=2)


def test_environment_block_is_commented_unless_set():
    off = build(nproc_per_node=1)
    assert "# export NCCL_DEBUG=INFO" in off and "# export OMP_NUM_THREADS=1" in off
    env = EnvSpec(omp_num_threads=4, nccl_debug="INFO", nccl_socket_ifname="eth0", nccl_ib_disable=True,
                  timeout_minutes=60, cuda_device_max_connections=1)
    on = build(nproc_per_node=1, env=env)
    for line in ("export OMP_NUM_THREADS=4", "export NCCL_DEBUG=INFO", "export NCCL_SOCKET_IFNAME=eth0",
                 "export NCCL_IB_DISABLE=1", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert line in on
    assert "distributed.timeout_minutes=60" in on


def test_preflight_runs_the_same_launcher_first():
    text = build(nproc_per_node=2, preflight=True)
    assert text.index('"${LAUNCH[@]}" -m distsetup.preflight') < text.index('exec "${LAUNCH[@]}" "$SCRIPT"')


@pytest.mark.parametrize("kwargs, message", [
    ({"num_nodes": 0}, "--num_nodes 0 must be at least 1"),
    ({"nproc_per_node": 0}, "--num_gpus_per_node 0 must be at least 1"),
    ({"num_nodes": 2, "node_rank": 2}, "--node_rank 2 is out of range"),
    ({"node_rank": -1}, "--node_rank -1 is out of range"),
    ({"backend": "deepspeed"}, "needs a DeepSpeed config file"),
    ({"gpus": (0, 1), "nproc_per_node": 4}, "--gpus lists 2 GPU(s)"),
    ({"rdzv_backend": "c10d", "launch_method": "deepspeed"}, "works with torchrun"),
    ({"num_nodes": 2, "hosts": ("a;rm", "b")}, "not a valid host name"),
    ({"config": "a\nb"}, "control character"),
    ({"ssh": True}, "--ssh is for the deepspeed launcher"),
])
def test_builder_rejects_bad_input(kwargs, message):
    with pytest.raises(DistsetupError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(**kwargs)


@pytest.mark.parametrize("text, expected", [("0,1", (0, 1)), (" 3 ", (3,)), ("auto:2", 2)])
def test_parse_gpus(text, expected):
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["auto:0", "auto:x", "0,,1", "a", "1,1"])
def test_parse_gpus_rejects(text):
    with pytest.raises(DistsetupError):
        parse_gpus(text)


# --- golden files --------------------------------------------------------------------------------

GOLDEN = {
    "launcher_single_ddp.sh": dict(config="config.yaml", nproc_per_node=4),
    "launcher_multinode_deepspeed_no_ssh.sh": dict(
        config="config.yaml", backend="deepspeed", deepspeed_config="config/ds_config.json",
        launch_method="deepspeed", num_nodes=2, nproc_per_node=8, node_rank=1, master_addr="10.1.2.3",
        master_port=29500),
    "launcher_fsdp_c10d_gpus_preflight_env.sh": dict(
        config="config.yaml", backend="fsdp", fsdp_config="config/fsdp_config.json", num_nodes=2,
        nproc_per_node=2, gpus=(2, 3), rdzv_backend="c10d", master_addr="node0", master_port=29400,
        preflight=True, env=EnvSpec(omp_num_threads=8, nccl_debug="WARN", nccl_ib_disable=True, timeout_minutes=45)),
    "launcher_accelerate_deepspeed.sh": dict(
        config="config.yaml", backend="deepspeed", deepspeed_config="ds.json", launch_method="accelerate",
        nproc_per_node=4),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden(name):
    check_golden(name, build_launcher_script(LaunchSpec(**GOLDEN[name]), command_line="distsetup launcher ..."))


def test_golden_mismatch_shows_a_diff(tmp_path, monkeypatch):
    import golden_files
    monkeypatch.setattr(golden_files, "GOLDEN_DIR", tmp_path)
    monkeypatch.delenv("UPDATE_GOLDEN", raising=False)
    (tmp_path / "x.sh").write_text("a\nb\n")
    with pytest.raises(AssertionError, match="(?s)UPDATE_GOLDEN=1.*-b\n\\+c"):
        check_golden("x.sh", "a\nc\n")
    monkeypatch.setenv("UPDATE_GOLDEN", "1")
    check_golden("x.sh", "a\nc\n")
    assert (tmp_path / "x.sh").read_text() == "a\nc\n"


# --- shellcheck over a grid ----------------------------------------------------------------------

def grid():
    for method, backend, nodes, rank, preflight, module in itertools.product(
            ("torchrun", "deepspeed", "accelerate"), ("ddp", "fsdp", "deepspeed", "single"), (1, 3),
            (None, 0), (False, True), (False, True)):
        spec = LaunchSpec(
            backend=backend, launch_method=method, script=None if module else f"{WEIRD}/train.py",
            module="pkg.train" if module else None, config=f"{WEIRD}/config.yaml",
            deepspeed_config=f"{WEIRD}/ds.json" if backend == "deepspeed" else None,
            fsdp_config=f"{WEIRD}/fsdp.json" if backend == "fsdp" else None, num_nodes=nodes,
            nproc_per_node=None if preflight and method == "torchrun" else 2, node_rank=rank,
            master_addr="host-0", preflight=preflight)
        yield spec
    yield LaunchSpec(num_nodes=2, nproc_per_node=2, rdzv_backend="c10d", rdzv_id=WEIRD, gpus=(0, 1),
                     env=EnvSpec(4, "INFO", "ib0", False, 30, 1, (("WEIRD", WEIRD),)))
    yield LaunchSpec(launch_method="deepspeed", num_nodes=2, nproc_per_node=2, hosts=("a", "b"), ssh=True)


def test_shellcheck_grid(tmp_path):
    paths = []
    for i, spec in enumerate(grid()):
        path = tmp_path / f"run_{i}.sh"
        path.write_text(build_launcher_script(spec, command_line=f"distsetup launcher --script '{WEIRD}'"))
        paths.append(path)
    assert len(paths) > 190
    shellcheck(paths)


def test_shellcheck_golden_files():
    shellcheck(sorted(Path(__file__).parent.joinpath("golden").glob("launcher_*.sh")))


def test_weird_values_survive_bash(tmp_path):
    """Every weird value reaches the training script unchanged (a fake torchrun echoes its argv)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    (fake / "torchrun").chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(build(config=f"{WEIRD}/config.yaml", script=f"{WEIRD}/train.py", backend="deepspeed",
                            deepspeed_config=f"{WEIRD}/ds.json", nproc_per_node=1))
    result = subprocess.run(["bash", str(script), "extra arg", "x=$y"], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    assert argv[-7:] == [f"{WEIRD}/train.py", "--config", f"{WEIRD}/config.yaml", "--deepspeed",
                         f"{WEIRD}/ds.json", "extra arg", "x=$y"]


# --- the command ---------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder with config.yaml and config/ds_config.json (batch 8 = 4 x 1 x world 2); the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    (tmp_path / "config.yaml").write_text(
        "distributed:\n  backend: deepspeed\n  deepspeed_config: config/ds_config.json\n")
    return tmp_path


def test_writes_an_executable_script_and_says_what_next(run_cli, project):
    result = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2")
    assert result.exit_code == 0, result.output
    script = project / "scripts" / "run_training.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    assert "Next: bash scripts/run_training.sh" in result.stderr
    text = script.read_text()
    assert "--deepspeed config/ds_config.json" in text and "distributed.backend=deepspeed" in text
    assert "#   distsetup launcher --config config.yaml --num_gpus_per_node 2" in text


def test_the_next_step_printed_by_distsetup_deepspeed_works(run_cli, project):
    result = run_cli("launcher", "--use_deepspeed", "--deepspeed_config", "config/ds_config.json")
    assert result.exit_code == 0, result.output
    assert "--deepspeed config/ds_config.json" in (project / "scripts" / "run_training.sh").read_text()


def test_dash_spellings_and_dry_run(run_cli, project):
    result = run_cli("launcher", "--num-gpus-per-node", "2", "--use-fsdp", "--dry-run", "--launch-method", "torchrun")
    assert result.exit_code == 0, result.output
    assert "distributed.backend=fsdp" in result.stdout
    assert not (project / "scripts").exists()


def test_flags_override_the_configs_backend(run_cli, project):
    result = run_cli("launcher", "--config", "config.yaml", "--use_fsdp", "--num_gpus_per_node", "2", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "distributed.backend=fsdp" in result.stdout and "--deepspeed" not in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--num_nodes", "0"], "--num_nodes 0 must be at least 1"),
    (["--num_gpus_per_node", "0"], "--num_gpus_per_node 0 must be at least 1"),
    (["--num_nodes", "2", "--node_rank", "2"], "--node_rank 2 is out of range for --num_nodes 2"),
    (["--num_gpus_per_node", "3"], "does not fit world size 3"),
    (["--num_nodes", "2", "--num_gpus_per_node", "2"], "does not fit world size 4"),
    (["--use_deepspeed", "--use_fsdp"], "mutually exclusive"),
    (["--gpus", "0,x"], "is not a list of GPU indices"),
    (["--num_gpus_per_node", "many"], "neither a number nor auto"),
])
def test_bad_input_is_an_error_and_writes_nothing(run_cli, project, args, message):
    result = run_cli("launcher", "--config", "config.yaml", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert not (project / "scripts").exists()


def test_gpus_auto_uses_distsetup_gpus(run_cli, project, monkeypatch):
    import distsetup.gpus
    monkeypatch.setattr(distsetup.gpus, "select_gpus", lambda count, **kw: [3, 1][:count])
    result = run_cli("launcher", "--use_fsdp", "--gpus", "auto:2", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "export CUDA_VISIBLE_DEVICES=3,1" in result.stdout and "NPROC_PER_NODE=2" in result.stdout


def test_command_does_not_import_torch():
    code = ("import sys; from distsetup.cli import cli; "
            "cli(['launcher', '--num_gpus_per_node', '2', '-o', '-'], standalone_mode=False); "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- real runs on CPU ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    return {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))}


def generate(run_cli, root: Path, *args, out_name: str = "run.sh") -> Path:
    out = root / out_name
    result = run_cli("launcher", "--config", root / "config.yaml", "--script", TRAIN, "-o", out, *args)
    assert result.exit_code == 0, result.output
    return out


def assert_trained(root: Path, result, backend: str, steps: int = 4):
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"], summary["backend"]) == (2, steps, backend), summary
    assert list((root / "out" / "checkpoints").glob(f"step_{steps:07d}/COMPLETE")), "no final checkpoint"
    return log


@pytest.mark.slow
@pytest.mark.parametrize("backend_args, method, backend", [
    (["--preflight"], "torchrun", "ddp"),
    (["--use_fsdp"], "torchrun", "fsdp"),
    (["--use_deepspeed", "--deepspeed_config", "DS"], "torchrun", "deepspeed"),
    (["--use_deepspeed", "--deepspeed_config", "DS"], "deepspeed", "deepspeed"),
    ([], "accelerate", "ddp"),
], ids=["torchrun-ddp-preflight", "torchrun-fsdp", "torchrun-deepspeed", "deepspeed-launcher", "accelerate-ddp"])
def test_single_node_script_trains(run_cli, tmp_path, backend_args, method, backend):
    root = write_project(tmp_path / WEIRD)   # the real run goes through the weird folder too
    args = [str(root / "ds.json") if a == "DS" else a for a in backend_args]
    script = generate(run_cli, root, "--num_gpus_per_node", "2", "--launch_method", method,
                      "--master_port", free_port(), *args)
    result = subprocess.run(["bash", str(script)], cwd=root, env=run_env(), capture_output=True, text=True,
                            timeout=400)
    log = assert_trained(root, result, backend)
    assert "no GPUs found: starting 2 CPU process(es) per node" in log
    if "--preflight" in backend_args:
        assert "preflight OK: 2 ranks" in log


@pytest.mark.slow
@pytest.mark.parametrize("method", ["torchrun", "deepspeed"])
def test_two_node_scripts_form_one_world(run_cli, tmp_path, method):
    root = write_project(tmp_path / "two nodes")
    port = free_port()
    backend = ["--use_deepspeed", "--deepspeed_config", root / "ds.json"] if method == "deepspeed" else []
    scripts = [generate(run_cli, root, "--num_nodes", 2, "--num_gpus_per_node", 1, "--node_rank", rank,
                        "--master_addr", "127.0.0.1", "--master_port", port, "--launch_method", method, *backend,
                        out_name=f"node{rank}.sh")
               for rank in (0, 1)]
    procs = [subprocess.Popen(["bash", str(s)], cwd=root, env=run_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for s in scripts]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, out[-4000:]
        assert f"node {rank} of 2" in out
    summary = json.loads((root / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4

"""`distsetup launcher`: the pure builder, golden scripts, shellcheck over a grid, bad input, real CPU runs."""

import itertools
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from golden_files import check_golden
from launch_inputs import DS_CONFIG, FSDP_CONFIG, WEIRD
from shell_checks import fake_tools, run_script, shellcheck

from distsetup.errors import DistsetupError
from distsetup.scripts.launch_plan import EnvSpec, LaunchSpec, build_launcher_script, parse_gpus


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
    assert 'exec "${LAUNCH[@]}" -m "$MODULE" "$@"' in text
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


def test_multinode_master_addr_is_read_at_run_time_unless_given(tmp_path):
    """Bug: several nodes without --master_addr wrote 127.0.0.1, and node 1 waited for itself forever."""
    text = build(num_nodes=2, nproc_per_node=8, node_rank=1)
    assert "127.0.0.1" not in text and "MASTER_ADDR is read at run time" in text
    missing = run_script(text, tmp_path)
    assert missing.returncode != 0 and "set MASTER_ADDR to the address of the first node" in missing.stderr
    given = run_script(text, tmp_path, env={"MASTER_ADDR": "10.0.0.5"}).stdout.splitlines()
    assert given[given.index("--master_addr") + 1] == "10.0.0.5"
    explicit = run_script(
        build(num_nodes=2, nproc_per_node=8, node_rank=1, master_addr="10.1.2.3"),
        tmp_path,
        env={"MASTER_ADDR": "10.0.0.5"},
    ).stdout.splitlines()
    assert explicit[explicit.index("--master_addr") + 1] == "10.1.2.3"
    single = run_script(build(nproc_per_node=2, master_port=29555), tmp_path).stdout.splitlines()
    assert single[single.index("--master_addr") + 1] == "127.0.0.1"


def test_c10d_needs_no_node_rank(tmp_path):
    """Bug: a c10d launch still demanded NODE_RANK, which c10d does not use."""
    result = run_script(build(num_nodes=2, nproc_per_node=2, rdzv_backend="c10d", master_addr="h0"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--node_rank" not in result.stdout and "c10d assigns node ranks" in result.stderr
    with pytest.raises(DistsetupError, match="--node_rank is not used with --rdzv_backend c10d"):
        build(num_nodes=2, nproc_per_node=2, rdzv_backend="c10d", node_rank=1)


def test_c10d_rendezvous():
    text = build(num_nodes=4, nproc_per_node=8, rdzv_backend="c10d", rdzv_id="job 7")
    assert '--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID"' in text
    assert "RDZV_ID='job 7'" in text


def test_deepspeed_backend_passes_its_file_to_train_py():
    text = build(backend="deepspeed", deepspeed_config="ds config.json", nproc_per_node=2)
    assert "TRAIN_ARGS=(distributed.backend=deepspeed --deepspeed 'ds config.json')" in text


def test_fsdp_backend_and_a_users_script_gets_no_overrides():
    text = build(backend="fsdp", fsdp_config="fsdp.json", nproc_per_node=2)
    assert """'distributed.fsdp_config="fsdp.json"'""" in text
    text = build(backend="deepspeed", deepspeed_config="ds.json", script="mine.py", config="c.yaml")
    assert "TRAIN_ARGS=(--config c.yaml --deepspeed ds.json)" in text


@pytest.mark.parametrize("method, flag", [("torchrun", "-m"), ("deepspeed", "--module"), ("accelerate", "-m")])
def test_default_target_is_the_packaged_trainer_as_a_module(tmp_path, method, flag):
    """Issue 11: the scripts ran the path src/train.py, which a wheel install does not have and which meant
    nothing from another folder; they now run `python -m distsetup.train` through each launcher's own
    module flag (torchrun -m, deepspeed --module, accelerate launch -m)."""
    text = build(config="c.yaml", launch_method=method, nproc_per_node=2)
    assert "MODULE=distsetup.train" in text and "src/train.py" not in text
    argv = run_script(text, tmp_path, method).stdout.splitlines()
    assert argv[argv.index("distsetup.train") - 1 :] == [
        flag,
        "distsetup.train",
        "--config",
        "c.yaml",
        "distributed.backend=ddp",
    ]


def test_overrides_go_to_the_default_trainer_only():
    """The packaged trainer (and its old path src/train.py, a thin file that runs it) takes section.key=value
    overrides; a user's own script or module does not."""
    assert LaunchSpec().runs_default_trainer and LaunchSpec(module="distsetup.train").runs_default_trainer
    assert LaunchSpec(script="src/train.py").runs_default_trainer
    assert "distributed.backend=ddp" in build_launcher_script(LaunchSpec(script="src/train.py"), command_line="d")
    for spec in (LaunchSpec(script="my_train.py"), LaunchSpec(module="pkg.train")):
        assert not spec.runs_default_trainer
        assert "distributed.backend" not in build_launcher_script(spec, command_line="distsetup launcher ...")
    with pytest.raises(DistsetupError, match="--script and --python_module are mutually exclusive"):
        build(script="a.py", module="pkg.train")


def test_module_target_per_launcher():
    assert 'exec "${LAUNCH[@]}" -m "$MODULE" "$@"' in build(script=None, module="pkg.train")
    text = build(script=None, module="pkg.train", launch_method="deepspeed", nproc_per_node=2)
    assert 'exec "${LAUNCH[@]}" --module "$MODULE" "$@"' in text


def test_deepspeed_launcher_single_and_multi_node():
    single = build(launch_method="deepspeed", nproc_per_node=2)
    assert 'LAUNCH+=(--num_gpus "$NPROC_PER_NODE")' in single and "--hostfile" not in single
    multi = build(launch_method="deepspeed", num_nodes=2, nproc_per_node=4, node_rank=0, hosts=("g1", "g2"))
    assert '--no_ssh --node_rank "$NODE_RANK"' in multi
    pdsh = build(launch_method="deepspeed", num_nodes=2, nproc_per_node=4, hosts=("g1", "g2"), ssh=True)
    assert "--launcher pdsh" in pdsh and "--no_ssh" not in pdsh


@pytest.mark.parametrize("nproc, visible, slots", [(None, "0,1,2", 3), (4, "0", 4)])
def test_deepspeed_hostfile_slots_are_the_process_count_at_run_time(tmp_path, nproc, visible, slots):
    """Bug: with the GPU count auto the hostfile said slots=1; it is now written when the count is known."""
    fake = fake_tools(tmp_path, "deepspeed")
    (fake / "deepspeed").write_text('#!/bin/bash\nwhile [[ "$1" != --hostfile ]]; do shift; done\ncat "$2"\n')
    text = build(
        launch_method="deepspeed", num_nodes=2, nproc_per_node=nproc, node_rank=0, master_addr="g1", hosts=("g1", "g2")
    )
    result = run_script(text, tmp_path, "deepspeed", env={"CUDA_VISIBLE_DEVICES": visible})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"g1 slots={slots}", f"g2 slots={slots}"]


def test_gpus_and_auto_count(tmp_path):
    text = build(gpus=(2, 3), nproc_per_node=2)
    # Bug: --gpus (NVML, PCI order) without CUDA_DEVICE_ORDER=PCI_BUS_ID could pick other GPUs in CUDA's order.
    env = run_script(text, tmp_path, show_env=("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")).stdout.splitlines()
    assert env[:2] == ["CUDA_VISIBLE_DEVICES=2,3", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    auto = build()
    assert "NPROC_PER_NODE=auto" in auto and 'NPROC_PER_NODE="$GPUS_FOUND"' in auto


def test_cpu_processes_are_announced():
    assert "no GPUs found: starting $NPROC_PER_NODE CPU process(es)" in build(nproc_per_node=2)


def test_environment_block_is_commented_unless_set():
    off = build(nproc_per_node=1)
    assert "# export NCCL_DEBUG=INFO" in off and "# export OMP_NUM_THREADS=1" in off
    env = EnvSpec(
        omp_num_threads=4,
        nccl_debug="INFO",
        nccl_socket_ifname="eth0",
        nccl_ib_disable=True,
        timeout_minutes=60,
        cuda_device_max_connections=1,
    )
    on = build(nproc_per_node=1, env=env)
    for line in (
        "export OMP_NUM_THREADS=4",
        "export NCCL_DEBUG=INFO",
        "export NCCL_SOCKET_IFNAME=eth0",
        "export NCCL_IB_DISABLE=1",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
    ):
        assert line in on
    assert "distributed.timeout_minutes=60" in on


def test_preflight_runs_the_same_launcher_first():
    text = build(nproc_per_node=2, preflight=True)
    assert text.index('"${LAUNCH[@]}" -m distsetup.preflight') < text.index('exec "${LAUNCH[@]}" -m "$MODULE"')


def test_script_enters_the_folder_it_was_written_in(tmp_path):
    """Issue 11: run from another folder, relative paths (config, DeepSpeed file, script) named files that
    were not there; the script now enters its WORKDIR first, from wherever it is started."""
    work = tmp_path / WEIRD
    work.mkdir()
    text = build(config="config.yaml", nproc_per_node=1, workdir=str(work))
    assert text.index("WORKDIR=") < text.index("# --- environment ---") < text.index('cd "$WORKDIR"')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_script(text, tmp_path, show_env=("PWD",), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"PWD={work}"
    assert 'cd "$WORKDIR"' not in build(nproc_per_node=1)  # no folder given: runs where it is started


def test_script_whose_folder_is_gone_says_so(tmp_path):
    result = run_script(build(nproc_per_node=1, workdir=str(tmp_path / "gone")), tmp_path)
    assert result.returncode == 1
    assert f"cannot enter {tmp_path / 'gone'} (where this script was written)" in result.stderr


@pytest.mark.parametrize(
    "kwargs, message",
    [
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
        ({"launch_method": "deepspeed", "num_nodes": 2, "gpus": (2, 3)}, "resets CUDA_VISIBLE_DEVICES"),
        ({"launch_method": "torchrn"}, "unknown launch method torchrn"),
        ({"workdir": "relative/dir"}, "is not an absolute path"),
        ({"workdir": "/a\nb"}, "control character"),
    ],
)
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
        config="config.yaml",
        backend="deepspeed",
        deepspeed_config="config/ds_config.json",
        launch_method="deepspeed",
        num_nodes=2,
        nproc_per_node=8,
        node_rank=1,
        master_addr="10.1.2.3",
        master_port=29500,
    ),
    "launcher_fsdp_c10d_gpus_preflight_env.sh": dict(
        config="config.yaml",
        backend="fsdp",
        fsdp_config="config/fsdp_config.json",
        num_nodes=2,
        nproc_per_node=2,
        gpus=(2, 3),
        rdzv_backend="c10d",
        master_addr="node0",
        master_port=29400,
        preflight=True,
        env=EnvSpec(omp_num_threads=8, nccl_debug="WARN", nccl_ib_disable=True, timeout_minutes=45),
    ),
    "launcher_multinode_torchrun_master_from_env.sh": dict(config="config.yaml", num_nodes=2, nproc_per_node=8),
    "launcher_accelerate_deepspeed.sh": dict(
        config="config.yaml",
        backend="deepspeed",
        deepspeed_config="ds.json",
        launch_method="accelerate",
        nproc_per_node=4,
    ),
}


GOLDEN_WORKDIR = "/home/user/project"  # the commands always write the folder they ran in


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden(name):
    spec = LaunchSpec(**GOLDEN[name], workdir=GOLDEN_WORKDIR)
    check_golden(name, build_launcher_script(spec, command_line="distsetup launcher ..."))


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
        ("torchrun", "deepspeed", "accelerate"),
        ("ddp", "fsdp", "deepspeed", "single"),
        (1, 3),
        (None, 0),
        (False, True),
        (False, True),
    ):
        spec = LaunchSpec(
            backend=backend,
            launch_method=method,
            script=None if module else f"{WEIRD}/train.py",
            module="pkg.train" if module else None,
            config=f"{WEIRD}/config.yaml",
            deepspeed_config=f"{WEIRD}/ds.json" if backend == "deepspeed" else None,
            fsdp_config=f"{WEIRD}/fsdp.json" if backend == "fsdp" else None,
            num_nodes=nodes,
            nproc_per_node=None if preflight and method == "torchrun" else 2,
            node_rank=rank,
            master_addr="host-0",
            preflight=preflight,
            workdir=f"/{WEIRD}" if rank is None else None,
        )
        yield spec
    yield LaunchSpec(
        num_nodes=2,
        nproc_per_node=2,
        rdzv_backend="c10d",
        rdzv_id=WEIRD,
        gpus=(0, 1),
        env=EnvSpec(4, "INFO", "ib0", False, 30, 1, (("WEIRD", WEIRD),)),
    )
    yield LaunchSpec(launch_method="deepspeed", num_nodes=2, nproc_per_node=2, hosts=("a", "b"), ssh=True)
    yield LaunchSpec(launch_method="deepspeed", num_nodes=2, hosts=("a", "b"), ssh=True)  # auto slots, MASTER_ADDR
    yield LaunchSpec(launch_method="deepspeed", num_nodes=2, node_rank=1)


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
    text = build(
        config=f"{WEIRD}/config.yaml",
        script=f"{WEIRD}/train.py",
        backend="deepspeed",
        deepspeed_config=f"{WEIRD}/ds.json",
        nproc_per_node=1,
    )
    result = run_script(text, tmp_path, args=("extra arg", "x=$y"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-7:] == [
        f"{WEIRD}/train.py",
        "--config",
        f"{WEIRD}/config.yaml",
        "--deepspeed",
        f"{WEIRD}/ds.json",
        "extra arg",
        "x=$y",
    ]


# --- the command ---------------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder with config.yaml and config/ds_config.json (batch 8 = 4 x 1 x world 2); the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    (tmp_path / "config.yaml").write_text(
        "distributed:\n  backend: deepspeed\n  deepspeed_config: config/ds_config.json\n"
    )
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_nodes", "0"], "--num_nodes 0 must be at least 1"),
        (["--num_gpus_per_node", "0"], "--num_gpus_per_node 0 must be at least 1"),
        (["--num_nodes", "2", "--node_rank", "2"], "--node_rank 2 is out of range for --num_nodes 2"),
        (
            ["--num_gpus_per_node", "3"],
            "8 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x world size 3 = 12",
        ),
        (["--num_nodes", "2", "--num_gpus_per_node", "2", "--master_addr", "h0"], "world size 4 = 16"),
        (["--use_deepspeed", "--use_fsdp"], "mutually exclusive"),
        (["--gpus", "0,x"], "is not a list of GPU indices"),
        (["--num_gpus_per_node", "many"], "neither a number nor auto"),
        (
            ["--gpus", "2,3", "--launch_method", "deepspeed", "--num_nodes", "2", "--master_addr", "h0"],
            "use --launch_method torchrun",
        ),
    ],
)
def test_bad_input_is_an_error_and_writes_nothing(run_cli, project, args, message):
    result = run_cli("launcher", "--config", "config.yaml", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert not (project / "scripts").exists()


def test_gpus_auto_uses_distsetup_gpus(run_cli, project, monkeypatch):
    import distsetup.planning.gpus

    monkeypatch.setattr(distsetup.planning.gpus, "select_gpus", lambda count, **kw: [3, 1][:count])
    result = run_cli("launcher", "--use_fsdp", "--gpus", "auto:2", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "export CUDA_VISIBLE_DEVICES=3,1" in result.stdout and "NPROC_PER_NODE=2" in result.stdout
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in result.stdout  # NVML's indices are in PCI bus order


def train_py_config(argv: list[str]):
    """The run config distsetup's trainer builds from `argv`, through its own parse_args and load_config."""
    from distsetup import train  # no torch: the trainer imports it inside train()

    return train.load_config(train.parse_args(argv))


def script_argv(result) -> list[str]:
    """What the script hands to distsetup's trainer, from a fake launcher's printed argv."""
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    return argv[argv.index("distsetup.train") + 1 :]


# File names YAML would misread: an alias (@), a flow list ([), a mapping (: ), a comment (#), a boolean.
YAML_TRAPS = ["@ds.json", "[x].json", "a: b.json", "#x.json", "a #b.json", "yes", "sp ace 'q\" $x.json"]


@pytest.mark.parametrize("kind", ["deepspeed", "fsdp"])
@pytest.mark.parametrize("name", YAML_TRAPS)
def test_file_names_yaml_would_misread_reach_train_py(run_cli, tmp_path, monkeypatch, name, kind):
    """Bug: --deepspeed_config / --fsdp_config went through YAML parsing (in the command and in train.py):
    tracebacks, or `yes` read as true. The generated script now hands train.py exactly the file named."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("distributed: {backend: ddp}\n")
    (tmp_path / name).write_text(json.dumps(DS_CONFIG if kind == "deepspeed" else FSDP_CONFIG))
    result = run_cli(
        "launcher",
        "--config",
        "config.yaml",
        f"--use_{kind}",
        f"--{kind}_config",
        name,
        "--num_gpus_per_node",
        "2",
        "-o",
        "run.sh",
    )
    assert result.exit_code == 0, result.output
    cfg = train_py_config(script_argv(run_script(tmp_path / "run.sh", tmp_path, cwd=tmp_path)))
    assert cfg.distributed.backend == kind
    assert getattr(cfg.distributed, f"{kind}_config") == name


def test_auto_values_are_refused_for_train_py(run_cli, project):
    """Bug: a DeepSpeed file with "auto" (HF Trainer only) was accepted for the trainer; every rank failed."""
    (project / "hf.json").write_text(json.dumps({**DS_CONFIG, "gradient_accumulation_steps": "auto"}))
    result = run_cli("launcher", "--deepspeed_config", "hf.json", "--num_gpus_per_node", "2", "-o", "-")
    assert result.exit_code != 0
    assert "gradient_accumulation_steps" in result.output and "Hugging Face Trainer" in result.output
    mine = run_cli(
        "launcher", "--deepspeed_config", "hf.json", "--num_gpus_per_node", "2", "--script", "hf.py", "-o", "-"
    )
    assert mine.exit_code == 0, mine.output  # a user's script may be the HF Trainer


def test_accelerate_gets_the_deepspeed_file_resolved_next_to_the_config(run_cli, tmp_path, monkeypatch):
    """Bug: a path relative to the config's folder went to accelerate unresolved (it resolves against cwd)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ds.json").write_text(json.dumps(DS_CONFIG))
    (tmp_path / "sub" / "config.yaml").write_text("distributed: {backend: deepspeed, deepspeed_config: ds.json}\n")
    result = run_cli(
        "launcher",
        "--config",
        "sub/config.yaml",
        "--launch_method",
        "accelerate",
        "--num_gpus_per_node",
        "2",
        "-o",
        "run.sh",
    )
    assert result.exit_code == 0, result.output
    fake = fake_tools(tmp_path, "accelerate")
    (fake / "accelerate").write_text(
        '#!/bin/bash\nwhile [[ "$1" != --deepspeed_config_file ]]; do shift; done\n[[ -f "$2" ]] && echo "found $2"\n'
    )
    run = run_script(tmp_path / "run.sh", tmp_path, "accelerate", cwd=tmp_path)
    assert run.stdout == "found sub/ds.json\n", run.stdout + run.stderr


@pytest.mark.parametrize("command", ["launcher", "slurm"])
def test_use_deepspeed_finds_config_ds_config_json(run_cli, project, command):
    """Bug: the README's quick start (the shipped config.yaml has no deepspeed_config) failed with a
    run config problem although `distsetup deepspeed --output config/ds_config.json` had written one."""
    (project / "config.yaml").write_text("distributed:\n  backend: ddp\n")
    result = run_cli(command, "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_deepspeed", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "using config/ds_config.json" in result.stderr
    assert (
        "TRAIN_ARGS=(--config config.yaml distributed.backend=deepspeed --deepspeed config/ds_config.json)"
        in result.stdout
    )
    (project / "config" / "ds_config.json").unlink()
    missing = run_cli(command, "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_deepspeed", "-o", "-")
    assert missing.exit_code != 0 and "run config problem" not in missing.output
    assert "--deepspeed_config" in missing.output and "--output config/ds_config.json" in missing.output


def test_use_fsdp_finds_config_fsdp_config_json_or_runs_without(run_cli, project, tmp_path):
    without = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_fsdp", "-o", "-")
    assert without.exit_code == 0, without.output
    assert "TRAIN_ARGS=(--config config.yaml distributed.backend=fsdp)" in without.stdout
    (project / "config" / "fsdp_config.json").write_text(json.dumps(FSDP_CONFIG))
    found = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_fsdp", "-o", "run.sh")
    assert found.exit_code == 0, found.output
    assert "using config/fsdp_config.json" in found.stderr
    cfg = train_py_config(script_argv(run_script(project / "run.sh", tmp_path, cwd=project)))
    assert cfg.distributed.fsdp_config == "config/fsdp_config.json"


def test_validation_errors_come_before_warnings(run_cli, project):
    """Nit: the "no --config" warning was printed before the error that stopped the command."""
    result = run_cli("launcher", "--num_nodes", "0")
    assert result.exit_code != 0 and "--num_nodes 0 must be at least 1" in result.output
    assert "Warning" not in result.output


def test_several_nodes_without_master_addr_read_it_at_run_time(run_cli, project):
    result = run_cli("launcher", "--num_nodes", "2", "--num_gpus_per_node", "8", "--node_rank", "1", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "127.0.0.1" not in result.stdout and 'MASTER_ADDR="${MASTER_ADDR:?' in result.stdout


def test_command_does_not_import_torch():
    code = (
        "import sys; from distsetup.cli.main import cli; "
        "cli(['launcher', '--num_gpus_per_node', '2', '-o', '-'], standalone_mode=False); "
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_relative_paths_hold_when_the_script_runs_from_another_folder(run_cli, project, tmp_path):
    """Issue 11: the command names files relative to where it ran; the script finds them from anywhere."""
    (project / "mine.py").write_text("")
    result = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2", "--script", "mine.py")
    assert result.exit_code == 0, result.output
    script = project / "scripts" / "run_training.sh"
    assert f"WORKDIR={project}" in script.read_text()
    fake = fake_tools(tmp_path, "torchrun")
    (fake / "torchrun").write_text('#!/bin/bash\nfor a in "$@"; do [[ -e "$a" ]] && echo "found $a"; done; true\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = run_script(script, tmp_path, "torchrun", cwd=elsewhere)
    assert run.stdout.splitlines() == ["found mine.py", "found config.yaml", "found config/ds_config.json"], (
        run.stdout + run.stderr
    )


def test_workdir_keeps_the_shells_spelling_of_this_folder(run_cli, tmp_path, monkeypatch):
    """$PWD (symbolic links kept, as users see the folder) when it is this folder, else the resolved one."""
    from distsetup.cli.launch_options import working_folder

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path / "link")
    monkeypatch.setenv("PWD", str(tmp_path / "link"))
    assert working_folder() == str(tmp_path / "link")
    monkeypatch.setenv("PWD", str(tmp_path))  # stale: another folder
    assert working_folder() == os.path.realpath(tmp_path / "real")


@pytest.mark.parametrize(
    "args", [["--module", "pkg.train"], ["--python_module", "pkg.train"], ["--python-module", "pkg.train"]]
)
def test_python_module_flag_and_its_old_spelling(run_cli, project, args):
    """Issue 11: --module meant a Python module here and an environment module in `slurm`; --python_module is
    the name in both, and --module keeps working for one release with a one-line warning."""
    result = run_cli("launcher", *args, "--num_gpus_per_node", "2", "-o", "run.sh")
    assert result.exit_code == 0, result.output
    text = (project / "run.sh").read_text()
    header = text.splitlines()[2]
    assert "MODULE=pkg.train" in text and "--python_module pkg.train" in header and "--module" not in header
    warnings = [line for line in result.stderr.splitlines() if "deprecated" in line]
    if args[0] == "--module":
        assert warnings == [
            "Warning: `launcher --module` is deprecated and goes in the next release: use "
            "--python_module (same meaning)."
        ]
    else:
        assert warnings == []
    both = run_cli("launcher", "--module", "a", "--python_module", "b", "-o", "-")
    assert both.exit_code != 0 and "give one of them" in both.output


def test_help_names_the_new_flags(run_cli):
    text = run_cli("launcher", "--help").stdout
    assert "--python_module" in text and "--module " not in text and "distsetup.train" in text

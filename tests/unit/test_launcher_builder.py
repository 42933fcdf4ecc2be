"""`distsetup launcher`'s pure builder: the script's shape, rendezvous and node ranks, each backend and launcher, the
module it runs, the environment block, the folder it enters, and bad input; scripts run under bash with fake launchers
that print what they were given."""

import glob
import shutil

import pytest
from launch_inputs import WEIRD
from shell_checks import fake_tools, run_script

from distsetup.errors import DistsetupError
from distsetup.scripts.environment import EnvSpec
from distsetup.scripts.launch_flags import parse_gpus
from distsetup.scripts.launch_plan import LaunchSpec, build_launcher_script


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
    """The scripts run `python -m distsetup.train` through each launcher's own module flag (torchrun -m, deepspeed
    --module, accelerate launch -m), not the path src/train.py, which a wheel install does not have and which
    means nothing from another folder."""
    text = build(config="c.yaml", launch_method=method, nproc_per_node=2)
    assert "MODULE=distsetup.train" in text and "src/train.py" not in text
    (tmp_path / "c.yaml").write_text("training:\n  max_steps: 2\n")  # the script checks it before the launch
    argv = run_script(text, tmp_path, method, cwd=tmp_path).stdout.splitlines()
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
    assert '"${LAUNCH[@]}" --module "$MODULE" "$@" &' in text  # a child (templates/_launch.sh.j2), not exec'd


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
    result = run_script(text, tmp_path, "deepspeed", "nvidia-smi", env={"CUDA_VISIBLE_DEVICES": visible})  # GPUs
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"g1 slots={slots}", f"g2 slots={slots}"]


def test_gpus_and_auto_count(tmp_path):
    text = build(gpus=(2, 3), nproc_per_node=2)
    # Bug: --gpus (NVML, PCI order) without CUDA_DEVICE_ORDER=PCI_BUS_ID could pick other GPUs in CUDA's order.
    shown = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    env = run_script(text, tmp_path, "torchrun", "nvidia-smi", show_env=shown).stdout.splitlines()  # a GPU machine's
    assert env[:2] == ["CUDA_VISIBLE_DEVICES=2,3", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    auto = build()
    assert "NPROC_PER_NODE=auto" in auto and 'NPROC_PER_NODE="$GPUS_FOUND"' in auto


def test_gpus_chosen_on_a_machine_without_gpus_stop_the_script_before_the_launcher(tmp_path):
    """--gpus 2,3 where there are none trained on CPU processes under torchrun without a word (CUDA_VISIBLE_DEVICES
    was counted as GPUs), and failed in the deepspeed launcher's traceback ("No slot '2'")."""
    result = run_script(build(gpus=(2, 3), nproc_per_node=2), tmp_path)
    gpus = (
        glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/kfd") + [shutil.which(t) for t in ("nvidia-smi", "rocm-smi")]
    )
    if any(gpus):  # a machine with NVIDIA or AMD GPUs: the launcher runs
        assert "but this machine has none" not in result.stderr
    else:
        assert result.returncode == 1 and result.stdout == ""  # the (fake) launcher never ran
        assert (
            "distsetup: --gpus 2,3 chose GPUs, but this machine has none; for CPU processes regenerate without --gpus"
            in (result.stderr)
        )


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
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=2",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
    ):
        assert line in on
    assert "distributed.timeout_minutes=60" in on


def test_preflight_runs_the_same_launcher_first():
    text = build(nproc_per_node=2, preflight=True)
    assert text.index('"${LAUNCH[@]}" -m distsetup.preflight') < text.index('exec "${LAUNCH[@]}" -m "$MODULE"')


def test_script_enters_the_folder_it_was_written_in(tmp_path):
    """The script enters its WORKDIR first, from wherever it is started, so that relative paths (config, DeepSpeed
    file, script) name the files they named where it was written."""
    work = tmp_path / WEIRD
    work.mkdir()
    text = build(config="config.yaml", nproc_per_node=1, workdir=str(work))
    (work / "config.yaml").write_text("training:\n  max_steps: 2\n")  # the script checks it before the launch
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
        ({"num_nodes": 2, "hosts": ("a", "b")}, "torchrun reads none, and would ignore it"),  # it was ignored
        ({"launch_method": "deepspeed", "num_nodes": 2, "hosts": ("a", "a")}, "--hosts names a twice"),
        ({"num_nodes": 2, "master_addr": "gpu 01"}, "--master_addr 'gpu 01' is not a host name"),
        ({"module": "my mod"}, "--python_module 'my mod' is not a module name"),
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


def test_weird_values_survive_bash(tmp_path):
    """Every weird value reaches the training script unchanged (a fake torchrun echoes its argv)."""
    text = build(
        config=f"{WEIRD}/config.yaml",
        script=f"{WEIRD}/train.py",
        backend="deepspeed",
        deepspeed_config=f"{WEIRD}/ds.json",
        nproc_per_node=1,
    )
    (tmp_path / WEIRD).mkdir(parents=True)
    (tmp_path / WEIRD / "train.py").write_text("")  # the script checks that it is there
    result = run_script(text, tmp_path, args=("extra arg", "x=$y"), cwd=tmp_path)
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


@pytest.mark.parametrize(
    "visible, nvidia_smi, torch_sees_one, preset, told",
    [
        (None, 6, 1, None, "true"),  # no nvidia-smi GPU and none torch sees: CPU processes
        ("", 0, 0, None, "true"),  # GPUs hidden
        (None, 0, 1, None, "<unset>"),  # nvidia-smi lists GPUs
        (None, 6, 0, None, "<unset>"),  # no NVIDIA GPU, but torch sees one (ROCm, XPU)
        (None, 6, 1, "false", "false"),  # the user's own choice stands
    ],
)
def test_accelerate_is_told_its_processes_are_cpu_ones_only_where_no_gpu_is_seen(
    tmp_path, visible, nvidia_smi, torch_sees_one, preset, told
):
    text = build(script="mine.py", launch_method="accelerate", nproc_per_node=2)
    fake = fake_tools(tmp_path, "accelerate", show_env=("ACCELERATE_USE_CPU",))
    for tool, status in (("nvidia-smi", nvidia_smi), ("python3", torch_sees_one)):  # python3 beside accelerate
        (fake / tool).write_text(f"#!/bin/bash\nexit {status}\n")
        (fake / tool).chmod(0o755)
    (tmp_path / "mine.py").write_text("")
    env = {
        key: value
        for key, value in (("CUDA_VISIBLE_DEVICES", visible), ("ACCELERATE_USE_CPU", preset))
        if value is not None
    }
    result = run_script(text, tmp_path, "accelerate", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"ACCELERATE_USE_CPU={told}"

"""Launcher scripts against golden files (a diff on mismatch; UPDATE_GOLDEN=1 regenerates them), and shellcheck
over a grid of launchers, backends and node layouts."""

import itertools

import pytest
from golden_files import GOLDEN_DIR, check_golden
from launch_inputs import ACCELERATE_HYBRID_FSDP, WEIRD
from shell_checks import shellcheck

from distsetup.scripts.environment import EnvSpec
from distsetup.scripts.launch_plan import LaunchSpec, build_launcher_script

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
            **(ACCELERATE_HYBRID_FSDP if (method, backend) == ("accelerate", "fsdp") else {}),
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
    shellcheck(sorted(GOLDEN_DIR.glob("launcher_*.sh")))

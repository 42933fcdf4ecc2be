"""SLURM job scripts built straight from a SlurmSpec (no CLI, no disk), for the SLURM script tests and the torchrun
grace-period run."""

import re

from distsetup.scripts.launch_plan import LaunchSpec
from distsetup.scripts.sbatch import SlurmSpec, build_slurm_script


def spec(nodes=2, gpus=4, launch=None, **kwargs) -> SlurmSpec:
    launch = launch or {}
    launch.setdefault("rdzv_backend", "c10d" if launch.get("launch_method", "torchrun") == "torchrun" else "static")
    return SlurmSpec(launch=LaunchSpec(num_nodes=nodes, nproc_per_node=gpus, config="config.yaml", **launch), **kwargs)


def build(**kwargs) -> str:
    return build_slurm_script(spec(**kwargs), command_line="distsetup slurm ...")


GRACE = re.compile(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+) ", re.M)

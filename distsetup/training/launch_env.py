"""Who this process is (rank, local rank, world, node), as the launcher's environment says: no torch, so that a
rank can tell before importing it whether it is the one to say an error (distsetup/train.py)."""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """This process's place in the job, as the launcher (torchrun, deepspeed, srun) described it."""

    rank: int
    local_rank: int
    size: int
    local_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SRUN_NAMES = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def read_world(srun_stands_in: bool = False) -> World:
    """The one place that reads RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (a plain run: 1 process; the
    deepspeed launcher sets LOCAL_SIZE instead, and without either every rank is taken to share one node). With
    `srun_stands_in` (preflight, which srun may start without torchrun), srun's own names stand in for those a
    launcher did not set; the trainer never reads them: inside an allocation they describe the job, not its ranks."""

    def number(name: str, default: int) -> int:
        value = os.environ.get(name) or (os.environ.get(SRUN_NAMES.get(name, "")) if srun_stands_in else None)
        return int(value) if value else default

    size = number("WORLD_SIZE", 1)
    return World(
        rank=number("RANK", 0),
        local_rank=number("LOCAL_RANK", 0),
        size=size,
        local_size=number("LOCAL_WORLD_SIZE", number("LOCAL_SIZE", size)),
    )

"""Who this process is (rank, world) and the process group it joins."""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distsetup.errors import DistsetupError


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


def read_world() -> World:
    """The one place that reads RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (a plain run: 1 process)."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    return World(rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")), size=size,
                 local_size=int(env.get("LOCAL_WORLD_SIZE", str(size))))


def pick_device(world: World) -> torch.device:
    """One GPU per process (LOCAL_RANK) when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def init_process_group(world: World, backend: str, device: torch.device, timeout_minutes: int) -> None:
    """Join the job's process group (NCCL on GPUs, gloo on CPU); `single` runs without one."""
    if backend == "single":
        if world.size > 1:
            raise DistsetupError(f"backend single runs one process, but WORLD_SIZE is {world.size}.",
                                 "set distributed.backend to ddp, fsdp or deepspeed, or launch one process.")
        return
    # DeepSpeed needs a process group even for one process; a plain `python train.py` has no rendezvous.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    # ...and DeepSpeed asserts LOCAL_RANK is set, which only a launcher does: describe the plain run to it.
    for key, value in (("RANK", world.rank), ("LOCAL_RANK", world.local_rank), ("WORLD_SIZE", world.size),
                       ("LOCAL_WORLD_SIZE", world.local_size)):
        os.environ.setdefault(key, str(value))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank,
                            world_size=world.size, timeout=datetime.timedelta(minutes=timeout_minutes))


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class PendingSum:
    """A sum over all ranks that travels while the caller goes on (the optimizer step); `result()` waits."""

    def __init__(self, values: torch.Tensor):
        self.values = values
        self.work = dist.all_reduce(values, async_op=True) if dist.is_initialized() else None

    def result(self) -> list[float]:
        if self.work is not None:
            self.work.wait()
        return self.values.tolist()

"""Who this process is (rank, world) and the process group it joins."""

import datetime
import functools
import os
import socket
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from distsetup.errors import DistsetupError, last_line
from distsetup.training.launch_env import World

T = TypeVar("T")


def pick_device(world: World) -> torch.device:
    """One GPU per process (LOCAL_RANK) when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    name_the_cpu_to_deepspeed()
    return torch.device("cpu")


def name_the_cpu_to_deepspeed() -> None:
    """Where torch sees no GPU, DS_ACCELERATOR=cpu (DeepSpeed's own setting; one the user set stays), before DeepSpeed
    is imported: what DeepSpeed would pick itself, but for its warning, on every rank, that it was "unable to
    detect" a GPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for the work queued on `device`: torch.cuda.synchronize on a GPU (CUDA runs it asynchronously, so
    a clock read without it times the queueing), nothing on the CPU."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_group_backend(device: torch.device, cpu_collectives: bool) -> str:
    """torch's backend for the job's process group: gloo on the CPU; NCCL on GPUs, with gloo beside it for the
    collectives on CPU tensors that `cpu_collectives` says the run makes (FSDP's CPU offload clips gradients that
    live on the CPU, which NCCL cannot reduce: pytorch#148532), as torchtitan does when it offloads."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


# TORCH_NCCL_ASYNC_ERROR_HANDLING: what NCCL's watchdog does when a collective fails or times out. torchrun sets 1
# (TearDown) where its own environment has none, and torch's own default is 3 (SkipCleanUp; ProcessGroupNCCL.hpp):
# both end the process from the watchdog thread, before the rank can say which rank it lost. 2 (CleanUpOnly) aborts
# the communicators and leaves the process alive: the collective's error (a DistBackendError) reaches the trainer,
# which says it in one line and exits (train.exit_now).
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # torch reads them in this order


def nccl_error_handling(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to add before an NCCL group is made: CleanUpOnly, unless the user chose a mode. torchrun's
    own 1 (set in each rank's environment when the launching shell had none) is not a choice; a value torchrun passes
    on from the shell reads the same, so a user who wants the process torn down with torchrun sets 3."""
    value = next((environ[name] for name in NCCL_ERROR_HANDLING if environ.get(name)), None)
    torchrun_default = value == "1" and "TORCHELASTIC_RUN_ID" in environ
    if value is None or torchrun_default:
        return {NCCL_ERROR_HANDLING[0]: "2"}
    return {}


def init_process_group(
    world: World, device: torch.device, timeout_minutes: float, cpu_collectives: bool = False
) -> None:
    """Join the job's process group: NCCL on GPUs, with gloo for `cpu_collectives`; gloo on CPU."""
    # DeepSpeed needs a process group even for one process; a plain `python train.py` has no rendezvous. When
    # nobody else joins, any free port: two such runs on one machine must not both take 29500.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()) if world.size == 1 else "29500")
    # ...and DeepSpeed asserts LOCAL_RANK is set, which only a launcher does: describe the plain run to it.
    for key, value in (
        ("RANK", world.rank),
        ("LOCAL_RANK", world.local_rank),
        ("WORLD_SIZE", world.size),
        ("LOCAL_WORLD_SIZE", world.local_size),
    ):
        os.environ.setdefault(key, str(value))
    if device.type == "cuda":  # read when an NCCL group is made: this one and every group made after it
        os.environ.update(nccl_error_handling(os.environ))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group(
        process_group_backend(device, cpu_collectives), rank=world.rank, world_size=world.size, timeout=timeout
    )
    # Groups made later (DeepSpeed's data-parallel group, FSDP's 2-D mesh) take torch's default timeout
    # (30 minutes), not ours: a stopped rank would hang them that long. Make ours their default too.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout


# How gloo and NCCL say a peer is gone; gloo raises a plain RuntimeError, so its text is all there is.
LOST_PEER = (
    "Timed out waiting",
    "timed out",
    "Connection reset by peer",
    "Connection closed by peer",
    "/gloo/transport/",
)


def any_rank(found: bool, device: torch.device) -> bool:
    """Whether any rank `found` it (one all-reduce on the process group's `device`); without a group, this one."""
    if not dist.is_initialized():
        return found
    flag = torch.tensor([float(found)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def decided_by_rank0(decide: Callable[[], T], patient: bool = False) -> T:
    """Rank 0's answer of `decide()` on every rank (one broadcast); without a process group, the answer here.
    When `decide` fails, rank 0's DistsetupError is raised on every rank; another exception is raised on rank 0
    (with its traceback) and said in one line on the others, which would otherwise wait for it until the
    collective timeout. `patient`: the others wait as long as rank 0 takes (tokenizing a corpus may take hours),
    on a gloo group without the run's collective timeout; torchrun ends them if rank 0 dies."""
    if not dist.is_initialized():
        return decide()
    answer: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            answer = [("answer", decide())]
        except DistsetupError as e:
            answer = [("error", (e.problem, e.hint))]
        except BaseException as e:  # also an interrupt: the others must not wait for an answer that never comes
            failure = e
            answer = [("error", (f"rank 0 stopped: {type(e).__name__}: {last_line(e)}.", "see rank 0's output."))]
    dist.broadcast_object_list(answer, src=0, group=_patient_group() if patient else None)
    if failure is not None:
        raise failure
    kind, value = answer[0]
    if kind == "error":  # rank 0's, on every rank: said once
        raise DistsetupError(*value, alike_on_every_rank=True)
    return value


@functools.cache
def _patient_group():
    """A gloo group of every rank whose collectives wait a week (created by every rank at its first use)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))


def is_lost_contact(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another rank stopped, hung or died."""
    return isinstance(error, dist.DistError) or any(text in str(error) for text in LOST_PEER)


def lost_contact(
    error: BaseException, world: World, step: int, timeout_minutes: float, hang: str | None = None
) -> DistsetupError:
    """The one line a rank prints when a collective failed: another rank stopped, hung or died. `hang`: what makes
    this run's ranks wait for each other, where something can."""
    return DistsetupError(
        f"rank {world.rank} of {world.size} lost contact with the other ranks at step {step} ({last_line(error)}): "
        "another rank stopped, hung or died.",
        "look at the other ranks' first error; "
        + (f"{hang}; " if hang else "")
        + f"if a step or a checkpoint legitimately takes longer than {timeout_minutes} min, raise "
        "distributed.timeout_minutes.",
    )


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _patient_group.cache_clear()


def ranks(count: int) -> str:
    """ "1 rank", "2 ranks": a world size in a sentence."""
    return f"{count} rank" + ("s" if count != 1 else "")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class StepAgreement:
    """What the ranks agree on after a step: the mean loss, whether to stop (a preemption signal reached at least
    one rank) and whether every rank's background checkpoint write is done. One small all-reduce settles them; it
    runs on steps the caller must agree on (logs,
    checkpoints) and otherwise about every `every_seconds`, so a signal is acted on within about that time
    while short steps do not each pay a collective (a gloo all-reduce costs a 50 ms CPU step 3%)."""

    def __init__(self, world_size: int, device: torch.device, every_seconds: float = 1.0):
        self.world_size, self.device, self.every_seconds = world_size, device, every_seconds
        self.next_step = 1

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def agree(
        self, step: int, terms: dict[str, torch.Tensor], stop_requested: bool, step_seconds: float, writing: bool
    ) -> tuple[dict[str, float], bool, bool]:
        """(the step's loss `terms`, each its mean over ranks; stop?; no rank writing?); every rank calls it at the
        same step."""
        names = list(terms)
        flags = torch.tensor([float(stop_requested), step_seconds, float(writing)], dtype=torch.float64)
        values = torch.cat([*(terms[name].double().reshape(1) for name in names), flags.to(self.device)])
        if dist.is_initialized():
            dist.all_reduce(values)
        *sums, stops, seconds_sum, writers = values.tolist()
        # The summed step time is the same on every rank, so they all pick the same next step.
        steps_per_period = self.every_seconds / max(seconds_sum / self.world_size, 1e-6)
        self.next_step = step + int(min(max(steps_per_period, 1), 1000))
        return {name: total / self.world_size for name, total in zip(names, sums, strict=True)}, stops > 0, writers == 0

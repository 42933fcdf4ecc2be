"""DeepSpeed's communication joined onto the run's process group, once per process, and said quietly."""

import os
import warnings

import torch

from distsetup.training.launch_env import World

# DeepSpeed 0.19 gathers and reduce-scatters with the names torch 2.13 deprecates: a FutureWarning on every rank that
# names calls the user never made
DEEPSPEED_CALLS_DEPRECATED = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def join_deepspeed_comm(world: World, device: torch.device) -> None:
    """DeepSpeed's communication onto the run's process group (else its config reads a world of 1), and only then,
    on CPU processes, LOCAL_SIZE, the deepspeed launcher's name for the processes on this node, where no launcher
    set it.

    DeepSpeed's CPU accelerator takes LOCAL_SIZE as its device count; without it (torchrun sets none) it asks
    `numactl` in a subprocess at every ZeRO-3 gradient reduction and counts NUMA nodes instead, and each
    subprocess resets Python's record of the warnings shown, so a warning meant once per process came once per
    step. DeepSpeed's words that no user can act on are not said."""
    import deepspeed

    warnings.filterwarnings("ignore", DEEPSPEED_CALLS_DEPRECATED, FutureWarning)
    if device.type == "cpu":  # the accelerators' DeepSpeed has no such op (and its record probes every op they have)
        leave_out_shared_memory_all_reduce()
    deepspeed.init_distributed()
    if device.type == "cpu":
        os.environ.setdefault("LOCAL_SIZE", str(world.local_size))


def leave_out_shared_memory_all_reduce() -> None:
    """DeepSpeed's communication on a CPU without its shared-memory all-reduce, which serves its inference tensor
    parallelism alone (`inference_all_reduce`) and no training step.

    Left in, the join compiles it on a machine's first run (half a minute to a minute), prints "built successfully"
    on every rank, and, where LOCAL_SIZE is set before the join (the deepspeed launcher sets it), maps a 69 MB
    /dev/shm buffer per rank that nothing unlinks when the run ends: more than a container's whole /dev/shm (64 MB
    unless raised). DeepSpeed builds no op it reads as incompatible, and keeps that record in one dict for edits."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False

"""DeepSpeed's communication joined onto the run's process group, once per process, and said quietly."""

import contextlib
import io
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
    step. Set before this join, it would turn on DeepSpeed's shared-memory all-reduce, whose /dev/shm buffers
    (69 MB a rank) are never unlinked. DeepSpeed's words that no user can act on are said once, or not at all."""
    import deepspeed

    warnings.filterwarnings("ignore", DEEPSPEED_CALLS_DEPRECATED, FutureWarning)
    # on every rank: "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", a plain print
    with contextlib.nullcontext() if world.is_main else contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed()
    if device.type == "cpu":
        os.environ.setdefault("LOCAL_SIZE", str(world.local_size))

"""ZeRO-3's fp32 master weights, where the run trains in fp32, are the partition's own tensor rather than a second
copy of it.

DeepSpeed's stage 3 means to do this itself: where a sub-group's flat partition already has the master weights'
dtype and is on the optimizer's device, `_create_fp32_partitions` takes the partition as its master ("we don't need
another copy of the weights"), and its step's copy back from master to partition then copies nothing. Its test
compares a tensor's `torch.device` with the accelerator's device name, a string, which is never equal (DeepSpeed
0.19.8, stage3.py), so every fp32 run clones the partition: 4 bytes a parameter / W more on every rank (a 200M GPT's
ranks at 8 CPU processes peaked at 1.07 of its whole fp32 model with the copy, 0.99 without: docs/benchmarks.md).
This applies the test as meant, after `deepspeed.initialize`."""

import torch


def share_master_weights(optimizer) -> None:
    """Make each fp32 master partition of ZeRO-3's `optimizer` the sub-group's flat partition itself, where the two
    have one dtype, device and size (fp32 training without an offloaded optimizer). The master tensors stay the
    objects the wrapped optimizer steps and keys its state by; only their storage changes, to the partition's, whose
    values they hold. Another optimizer, or one where nothing qualifies, is left as it is."""
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    partitions = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    if getattr(optimizer, "offload_optimizer", False):  # DeepSpeed's test comes after its offload's copy
        return
    if not masters or not partitions or len(masters) != len(partitions):
        return
    for master, partition in zip(masters, partitions, strict=True):
        if _copy_of(master, partition):
            master.data = partition.data


def _copy_of(master: torch.Tensor, partition: torch.Tensor | None) -> bool:
    """Whether `master` is a separate copy of `partition` that the partition itself could stand in for."""
    return (
        partition is not None
        and master.data_ptr() != partition.data_ptr()  # not the partition already
        and master.dtype == partition.dtype
        and master.device == partition.device
        and master.shape == partition.shape
        and torch.equal(master, partition)
    )

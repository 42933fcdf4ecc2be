"""The bytes each ZeRO stage really holds on a rank, read from DeepSpeed's engine (summary.json's `memory`): where
its optimizer keeps the gradients and the fp32 master copies, which are not the parameters' own tensors."""

from typing import TYPE_CHECKING

from distsetup.training import memory

if TYPE_CHECKING:  # imported by the run that uses it: a DDP run never imports DeepSpeed
    from deepspeed import DeepSpeedEngine


def held_grad_bytes(engine: "DeepSpeedEngine") -> int:
    """Gradients at the accumulation boundary (before the step frees them): full .grad (stages 0-1) or this rank's
    partitions."""
    opt = engine.optimizer
    tensors = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
        tensors += memory.state_tensors(getattr(opt, name, None))
    # ZeRO-Offload accumulates this rank's gradients on its CPU master partition.
    tensors += [
        t.grad
        for t in memory.state_tensors(getattr(opt, "single_partition_of_fp32_groups", None))
        if t.grad is not None
    ]
    tensors += memory.state_tensors(getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None))
    return memory.tensor_bytes(tensors)


def held_bytes(engine: "DeepSpeedEngine", zero_stage: int, grad_bytes: int) -> dict[str, int]:
    """Parameters (ZeRO-3: this rank's partitions and the persistent ones whole), the gradients counted before the
    step (`grad_bytes`), the optimizer's state and the fp32 master copies of this rank's partition (ZeRO 1-2 keep
    them even when training in fp32; ZeRO-3's are then the partition itself: zero3_master_weights)."""
    opt, params = engine.optimizer, list(engine.module.parameters())
    if zero_stage == 3:
        held = [p.ds_tensor for p in params] + [p.data for p in params if getattr(p, "ds_persist", False)]
    else:
        held = params
    inner = getattr(opt, "optimizer", opt)
    master = []
    if zero_stage:
        master = memory.state_tensors(getattr(opt, "single_partition_of_fp32_groups", None))
        master += memory.state_tensors(getattr(opt, "fp32_partitioned_groups_flat", None))
    param_bytes = memory.tensor_bytes(held)
    return {
        "params": param_bytes,
        "grads": grad_bytes,
        "optimizer": memory.tensor_bytes(memory.state_tensors(inner.state)),
        "master_params": memory.tensor_bytes(held + master) - param_bytes,  # a master that is the partition: none
    }

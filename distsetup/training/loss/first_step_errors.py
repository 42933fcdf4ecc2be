"""What an error at a run's first step says: whether it is the user's code refusing its input (said in one line
naming the setting to fix, by the objectives), what the batch was, and the fix where a forward mixes fp32 with the
16-bit weights a backend made without torch.autocast."""

import re

import torch

from distsetup.errors import DistsetupError
from distsetup.training.model import moe
from distsetup.training.world import is_lost_contact


def rejected_input(error: Exception) -> bool:
    """Whether an error of the first step is the user's code refusing its input, said in one line (not a lost peer,
    a device out of memory, torch.compile failing, a ZeRO-3 leaf's hook refusing an in-place change or a line said
    already, which go on as they are)."""
    compiling = type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))
    hooked = moe.leaf_hook_refused(error)  # the DeepSpeed backend names the layer
    said = isinstance(error, DistsetupError)
    return not (is_lost_contact(error) or isinstance(error, torch.OutOfMemoryError) or compiling or hooked or said)


def mixed_dtypes_fix(error: Exception, weights_cast: str | None) -> str | None:
    """The fix where a forward failed for a tensor in fp32 meeting the 16-bit weights that `weights_cast` says how the
    backend made, without torch.autocast (which single and DDP runs have, as Accelerate gives FSDP2 too, and which
    would cast it); None where that is not the error."""
    message = str(error)  # e.g. "mat1 and mat2 must have the same dtype, but got Float and BFloat16"
    # or a CPU LayerNorm's "mixed dtype (CPU): expect parameter to have scalar type of Float", its input fp32
    sixteen_bit = "BFloat16" in message or "Half" in message or message.startswith("mixed dtype")
    if weights_cast is None or not sixteen_bit or not re.search(r"\bfloat\b", message, re.IGNORECASE):
        return None
    return (
        f"{weights_cast} in the forward, with no torch.autocast: cast what it computes in fp32 (a buffer such as a "
        "rotary inv_freq, a tensor it creates) to its input's dtype, e.g. .to(x.dtype)."
    )


def described_batch(batch) -> str:
    """The batch's structure with its tensors' shapes: {'image': [8, 3, 32, 32], 'label': [8]}."""
    if isinstance(batch, torch.Tensor):
        return str(list(batch.shape))
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k!r}: {described_batch(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, list | tuple):
        inner = ", ".join(described_batch(v) for v in batch)
        return f"({inner})" if isinstance(batch, tuple) else f"[{inner}]"
    return type(batch).__name__

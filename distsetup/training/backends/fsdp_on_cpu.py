"""FSDP2 on the CPU: one layer's gathered weights and gradients at a time.

FSDP2 is built for a GPU, where its collectives run on streams of their own beside the compute. To overlap them it
gathers the next layer's weights before backward reaches it, keeps a layer's all-gather output in forward until the
next layer's is copied out, and keeps each layer's flat gradient buffer (its reduce-scatter input) until the next
layer's reduce-scatter. On the CPU a collective is done when its call returns: none of these buys time, and each
holds a layer's worth of memory (docs/benchmarks.md: a 200M model's ranks at 8 processes held 0.90 of the whole
model, and 0.82 without them; a small model's CPU step is faster without them too)."""

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

try:  # torch >= 2.8 (setup.cfg: 2.6): FSDP2's collectives can be replaced
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - an older torch keeps FSDP2's gradient buffers, as on a GPU
    ReduceScatter = None  # type: ignore[assignment,misc]

# torch's name for it from 2.13 (the older one warns there)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def hold_one_layer_at_a_time(sharded: list[nn.Module]) -> None:
    """Each of the modules fully_shard made FSDP2's units (the root among them) gathered where it is used and
    released as soon as it is not."""
    for module in (cast(FSDPModule, m) for m in sharded):
        # FSDP2's one switch for its default backward prefetch (the next unit) is naming the units to prefetch: a
        # unit naming itself prefetches nothing, being gathered already
        module.set_modules_to_backward_prefetch([module])
        # an all-gather waited for where its layer needs it: its output freed once copied out, not a layer later
        if hasattr(module, "_set_unshard_async_op"):  # not in every torch setup.cfg allows
            module._set_unshard_async_op(True)
        if ReduceScatter is not None:
            module.set_custom_reduce_scatter(ReduceScatterFreeingItsInput())


if ReduceScatter is not None:

    class ReduceScatterFreeingItsInput(ReduceScatter):
        """torch's reduce-scatter, after which its input, a layer's gradients copied flat, is freed: FSDP2 holds on
        to that tensor until the next layer's reduce-scatter, for a GPU's stream that may still be reading it."""

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False) -> None:
            REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group)
            input_tensor.untyped_storage().resize_(0)

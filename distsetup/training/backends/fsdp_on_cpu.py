"""FSDP2 on the CPU: one layer's gathered weights and gradients at a time.

FSDP2 is built for a GPU, where its collectives run on streams of their own beside the compute. To overlap them it
gathers the next layer's weights before backward reaches it, keeps a layer's all-gather output in forward until the
next layer's is copied out, and keeps each layer's flat gradient buffer (its reduce-scatter input) until the next
layer's reduce-scatter. On the CPU a collective is done when its call returns: none of these buys time, and each
holds a layer's worth of memory (docs/benchmarks.md: a 200M model's ranks at 8 processes held 0.90 of the whole
model with them, 0.82 without). A rank without room also hands its heap's free pages back after each reduce-scatter
(0.70 over 5 steps in a 7 GiB container, at 10-12% of a small model's step)."""

from typing import cast

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from distsetup.training.host_allocator import hand_back_freed_heap

try:  # torch >= 2.8 (setup.cfg allows 2.6): FSDP2's collectives can be replaced
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # pragma: no cover - an older torch keeps FSDP2's gradient buffers, as on a GPU
    DefaultReduceScatter = None  # type: ignore[assignment,misc]


def hold_one_layer_at_a_time(sharded: list[nn.Module], short_of_room: bool = False) -> None:
    """Each of the modules fully_shard made FSDP2's units (the root among them) gathered where it is used and
    released as soon as it is not; with `short_of_room`, for a rank without room (FSDPBackend.fit_to_the_model),
    the heap's free pages also handed back to the system after each layer's reduce-scatter."""
    for module in (cast(FSDPModule, m) for m in sharded):
        # FSDP2's one switch for its default backward prefetch (the next unit) is naming the units to prefetch: a
        # unit naming itself prefetches nothing, being gathered already
        module.set_modules_to_backward_prefetch([module])
        # each all-gather waited for where its layer needs it, so that forward frees its output once copied out,
        # not a layer later: a private method (torch's own tests set it), not taken for granted
        if hasattr(module, "_set_unshard_async_op"):
            module._set_unshard_async_op(True)
        if DefaultReduceScatter is not None:
            module.set_custom_reduce_scatter(ReduceScatterFreeingItsInput(short_of_room))


if DefaultReduceScatter is not None:

    class ReduceScatterFreeingItsInput(DefaultReduceScatter):
        """FSDP2's own reduce-scatter, done before it returns, and then its input, a layer's gradients copied flat,
        freed: FSDP2 holds on to that tensor until the next layer's reduce-scatter, for a GPU's stream that may
        still be reading it."""

        def __init__(self, then_hand_back_freed_heap: bool = False):
            super().__init__()
            self.then_hand_back_freed_heap = then_hand_back_freed_heap

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            done = super().__call__(output_tensor, input_tensor, group, op, async_op=False)
            input_tensor.untyped_storage().resize_(0)
            if self.then_hand_back_freed_heap:
                hand_back_freed_heap()
            return done

"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in backward."""

import contextlib

from distsetup.training.backends.base import Backend
from distsetup.training.model import moe


class DDPBackend(Backend):
    """DistributedDataParallel: gradients all-reduced in backward, skipped with no_sync() while accumulating."""

    name = "ddp"

    def _handle_conditional(self, layers):
        if layers:
            self.notes.append(
                f"{moe.described(layers)} may run other experts on each rank: DDP looks for unused parameters "
                "(find_unused_parameters)"
            )

    def _place(self, model, parts):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view: .grad aliases the all-reduce buckets, so gradients are held once.
        return DDP(model, device_ids=ids, gradient_as_bucket_view=True, find_unused_parameters=bool(parts.conditional))

    def _plain_model(self):
        return self.model.module

    def _sync(self, last_micro):
        return contextlib.nullcontext() if last_micro else self.model.no_sync()

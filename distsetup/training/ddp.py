"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in backward."""

import contextlib

import torch

from distsetup.training.backend import Backend


class DDPBackend(Backend):
    """DistributedDataParallel: gradients all-reduced in backward, skipped with no_sync() while accumulating."""

    name = "ddp"

    def wrap(self, model, blocks):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self._checkpoint_activations(model, blocks)
        ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view: .grad aliases the all-reduce buckets, so gradients are held once.
        self.model = DDP(model.to(self.device), device_ids=ids, gradient_as_bucket_view=True)
        self._build_optimizer(self.model)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None

    def _plain_model(self):
        return self.model.module

    def _sync(self, last_micro):
        return contextlib.nullcontext() if last_micro else self.model.no_sync()

"""Layers that keep running statistics (BatchNorm's, an InstanceNorm told to track them): buffers that their forward
updates in training mode. The backends treat them apart: kept equal on every rank (backends/rank0_buffers.py),
updated once a step under activation checkpointing (blocks.py), computed in fp32 beside 16-bit weights under FSDP2
(backends/fsdp_precision.py)."""

import torch.nn as nn


def keeps_running_statistics(module: nn.Module) -> bool:
    """Whether `module` itself (not its children) updates running statistics in training mode."""
    return bool(getattr(module, "track_running_stats", False)) and getattr(module, "running_mean", None) is not None

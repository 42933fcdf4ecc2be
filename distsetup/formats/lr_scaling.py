"""Learning-rate scaling with the global batch size (Goyal et al.: linear; Krizhevsky: sqrt)."""

import math

SCALING_RULES = ("linear", "sqrt")  # what a --scale_lr flag takes; its absence is "none"
RULES = ("none", *SCALING_RULES)


def scaled_lr(lr: float, global_batch: int, base_batch: int | None, rule: str) -> float:
    """lr tuned at `base_batch`, scaled to `global_batch` by `rule` (only rule "none" needs no base batch)."""
    if rule == "none":
        return lr
    if base_batch is None:
        raise ValueError(f"scaling the lr by rule {rule!r} needs the batch size it was tuned at.")
    ratio = global_batch / base_batch
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))

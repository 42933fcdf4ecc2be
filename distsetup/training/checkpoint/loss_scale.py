"""The fp16 loss scale a checkpoint carries from one backend to another.

A named state (named_state.py) holds it as torch's GradScaler state: the scale, the good steps counted toward
the next growth (`_growth_tracker`) and the growth settings. DeepSpeed's ZeRO 1-3 pickle their DynamicLossScaler
in every rank's optimizer file and in a universal folder's zero/optimizer_state.pt ("loss_scaler"). A conversion
carries the scale and how many good steps remain before it next grows. The two scalers count differently:
GradScaler grows at the `growth_interval`-th good step after an overflow, DeepSpeed at the (`scale_window` + 1)-th,
and only DeepSpeed has hysteresis (overflows it tolerates before it halves). So a scale carried from DeepSpeed to a
torch backend, just after an overflow, grows one step earlier, and tolerates no overflow; one carried from torch to
DeepSpeed has no hysteresis left until its first growth refills it.
"""

from typing import Any


def from_deepspeed(scaler: Any) -> dict | None:
    """GradScaler state of DeepSpeed loss scaler `scaler`; None for a static one (bf16, fp32, a fixed fp16 scale)."""
    if not getattr(scaler, "dynamic", False):
        return None
    window = scaler.scale_window
    return {
        "scale": float(scaler.cur_scale),
        "growth_factor": float(scaler.scale_factor),
        "backoff_factor": 1.0 / scaler.scale_factor,
        "growth_interval": window,
        "_growth_tracker": max(window - _steps_to_growth(scaler), 0),
    }


def to_deepspeed(state: dict) -> Any:
    """GradScaler state `state` as the DynamicLossScaler a DeepSpeed checkpoint pickles, with its growth settings."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(
        init_scale=float(state["scale"]),
        scale_window=state["growth_interval"],
        min_scale=1,  # DeepSpeed's min_loss_scale default
        delayed_shift=1,  # no hysteresis, as in torch
        consecutive_hysteresis=False,
    )
    scaler.scale_factor = state["growth_factor"]
    _grow_after(scaler, state["growth_interval"] - state["_growth_tracker"])
    return scaler


def restore(scaler: Any, saved: Any) -> None:
    """Give a DeepSpeed run's own dynamic loss scaler `scaler` (its file's settings) the scale, growth position and
    hysteresis left of `saved`, a checkpoint's DeepSpeed loss scaler; nothing where either is static."""
    if not (getattr(scaler, "dynamic", False) and getattr(saved, "dynamic", False)):
        return
    scaler.cur_scale = max(saved.cur_scale, scaler.min_scale)
    _grow_after(scaler, min(_steps_to_growth(saved), scaler.scale_window + 1))
    scaler.cur_hysteresis = min(saved.cur_hysteresis, scaler.delayed_shift)


def _steps_to_growth(scaler: Any) -> int:
    """Good steps, the next one counted, until DeepSpeed scaler `scaler` grows its scale. It grows after a good
    step whose count since the last overflow, less one, is a positive multiple of its window."""
    stable = scaler.cur_iter - scaler.last_overflow_iter - 1
    return scaler.scale_window + 1 if stable == 0 else -stable % scaler.scale_window + 1


def _grow_after(scaler: Any, steps: int) -> None:
    """Set DeepSpeed scaler `scaler` to grow after `steps` (1 to its window + 1) good steps."""
    scaler.last_overflow_iter = -1
    scaler.cur_iter = scaler.scale_window + 1 - steps

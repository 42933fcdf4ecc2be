"""A model constructed in its ZeRO-3 partitions, so that no rank holds it whole (the DeepSpeed backend's construct)."""

from collections.abc import Callable

import torch
import torch.nn as nn

from distsetup.errors import first_line
from distsetup.training.model import from_rank0, pretrained
from distsetup.training.world import any_rank, is_lost_contact


class NotPartitioned(Exception):
    """The builder cannot build the model inside deepspeed.zero.Init: it reads a parameter's size (0 there), so that
    it fails or builds another model than on the meta device. Said why, in one line."""


def partitioned(
    build: Callable[[], nn.Module],
    whole: nn.Module,
    source: pretrained.Pretrained | None,
    ds_config: dict,
    is_main: bool,
    device: torch.device,
) -> nn.Module:
    """The model built inside deepspeed.zero.Init (with this run's DeepSpeed file `ds_config`, on the process group
    DeepSpeed's communication has joined): each parameter partitioned as it is created; then rank 0's values (its
    `whole` model: the run's seed on the CPU, --init_from's or a Hugging Face folder's weights; or, where `source`
    holds every parameter, read from it one at a time) put into every rank's partitions, one parameter at a time,
    and every buffer broadcast from rank 0."""
    import deepspeed

    failed = ""
    try:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # the builder's own (a parameter partitioned as it is created reads as empty)
        if is_lost_contact(e):
            raise
        failed = first_line(e).rstrip(".")
    failed = failed or _differently_built(model, whole)
    if any_rank(bool(failed), device):  # every rank takes the same way, whatever one of them found
        raise NotPartitioned(failed or "on another rank")
    values = dict(whole.named_parameters()) if is_main and source is None else {}
    for name, parameter in model.named_parameters():
        with deepspeed.zero.GatheredParameters([parameter], modifier_rank=0), torch.no_grad():
            if is_main:
                parameter.data.copy_(source.whole(name) if source is not None else values[name].data)
    # zero.Init made the buffers in the run's 16-bit dtype and wherever their constructor put them; the engine,
    # given a model built that way, moves none: rank 0's, in the dtype it built them in (fp32 rotary frequencies
    # stay fp32, as the engine keeps them), onto this rank's device
    from_rank0.broadcast_buffers(model, dict(whole.named_buffers(remove_duplicate=False)), device, is_main)
    if source is not None:
        pretrained.read_persistent_buffers(model, source)
    return model


def _differently_built(model: nn.Module, whole: nn.Module) -> str:
    """How the model built in partitions differs from the one built on the meta device (or rank 0's), by its
    parameters' names and shapes; "" where it does not."""
    made = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters()}
    meant = {name: tuple(p.shape) for name, p in whole.named_parameters()}
    if made == meant:
        return ""
    name = next((name for name in meant if made.get(name) != meant[name]), None) or next(iter(made.keys() - meant))
    return f"its parameter {name} came out {list(made.get(name) or [])} there, {list(meant.get(name) or [])} elsewhere"

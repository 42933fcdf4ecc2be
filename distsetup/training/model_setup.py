"""The trainer's model before the backend wraps it: where its values come from and which rank builds it whole, the
node's memory against it, and its FLOPs for MFU.

Only rank 0 builds the model's values (the run's seed, --init_from's weights, a Hugging Face folder's); the others
build it on the meta device, and the backend fills their copies or shards with rank 0's values. Where the backend
shards the model (FSDP2, ZeRO-3) and the run starts from a checkpoint holding every parameter, no rank builds it
whole: every rank builds a skeleton and reads its part (model/pretrained.py).
"""

from collections.abc import Callable

import torch
import torch.nn as nn

from distsetup.formats.runconfig import ModelConfig
from distsetup.planning.loss_slices import slice_width
from distsetup.training.backends.base import Backend
from distsetup.training.checkpoint.export import load_weights
from distsetup.training.data.datasets import Datasets
from distsetup.training.data.loader import Placement, fetched, placed
from distsetup.training.launch_env import World
from distsetup.training.loss.sliced import LossHead
from distsetup.training.model import build as models
from distsetup.training.model import pretrained
from distsetup.training.model.throughput import counted_flops, flops_per_token
from distsetup.training.world import decided_by_rank0


def check_model_fits(
    m: ModelConfig, description: models.Description, backend: Backend, world: World, device: torch.device
) -> None:
    """This node's memory against the model: the processes that build it whole (rank 0 alone, on its node, where
    the others build it on the meta device) and, on a CPU, every process's training state."""
    parameters = description.parameters
    builders = int(world.rank == world.local_rank) if description.builds_on_meta else world.local_size
    holders = world.local_size if device.type == "cpu" else 0
    state = models.training_state_bytes(backend.memory_strategy, parameters, world, backend.precision)
    models.check_model_fits(parameters, builders, models.size_settings(m), holders, state)


def whole_model(
    m: ModelConfig,
    init_from: str | None,
    description: models.Description,
    backend: Backend,
    world: World,
    say: Callable[[str], None],
) -> tuple[nn.Module, pretrained.Pretrained | None]:
    """The model whole, with --init_from's weights, and the checkpoint each rank reads its part of instead, if any:
    built on rank 0 alone, the others building it on the meta device; or, where the backend shards it and the run
    starts from a checkpoint holding every parameter, a skeleton on every rank (parameters on the meta device,
    buffers built). A builder that cannot build on the meta device (it reads a weight) is built whole on every
    rank."""
    reads_parts = backend.fills_shards_from_rank0 and description.builds_on_meta
    source = pretrained.source_of(m, init_from) if reads_parts else None  # each rank's, mapped once
    if description.builds_on_meta:  # rank 0 reads the weights' ties against the model's as its config makes them
        decided_by_rank0(lambda: pretrained.check_ties_of(m, init_from, source))
    if source is not None:
        skeleton = pretrained.skeleton(m)
        if init_from:
            load_weights(skeleton, init_from, source.export)  # its keys checked, as every run's; mapped once
        if pretrained.covers(source, skeleton):  # no rank builds it whole: each reads its part
            say(f"note: weights read a part at a time from {source.path} ({backend.reads_pretrained})")
            return skeleton, source
        source.close()  # it misses a parameter: rank 0 builds the model whole, as its library fills the rest
    on_meta = description.builds_on_meta and not world.is_main
    whole = models.architecture_on_meta(m) if on_meta else models.build(m)  # whole: said in the description's note
    if init_from:
        load_weights(whole, init_from)  # on the meta device: the keys checked, nothing read
    return whole, None


def flops_per_item(
    m: ModelConfig,
    module: nn.Module,
    data: Datasets,
    micro_batch: int,
    peak: float | None,
    loss_on: Callable[[nn.Module, object], torch.Tensor],
    say: Callable[[str], None],
) -> float | None:
    """Training FLOPs per token (or sample) for MFU: the transformer formula for the built-in GPT and Hugging Face
    models; else counted on a copy on the meta device (`loss_on(model, batch)`, the objective's loss), only where MFU
    can be computed (a `peak` is known)."""
    if m.type != "python" and data.tokens:
        return flops_per_token(module, m.block_size)
    if not peak:
        return None
    batch = fetched(data.train, list(range(micro_batch)), data.collate)
    on_meta = placed(batch, Placement(torch.device("meta")))  # shapes and dtypes, no data
    flops, why_not = counted_flops(m, lambda model: loss_on(model, on_meta))
    if flops is None:
        say(f"note: MFU left out: the FLOPs of the model cannot be counted ({why_not})")
        return None
    return flops / (micro_batch * (m.block_size if data.tokens else 1))


def largest_activation_bytes(module: nn.Module, tokens: int) -> int:
    """A micro-batch's widest activation, in fp32 bytes: its `tokens` x the widest output of the model's nn.Linear
    layers (of an output head computing the loss in slices, one slice's). `tokens` 0 (a python data.builder's
    samples, whose size is not known): 0."""
    widths = [
        slice_width(m.out_features) if isinstance(m, LossHead) else m.out_features
        for m in module.modules()
        if isinstance(m, nn.Linear)
    ]
    return 4 * tokens * max(widths, default=0)

"""`distsetup fsdp`: write an FSDP config with Accelerate's key names."""

import shlex
from typing import Any

import click

from distsetup.cli.options import IntegerRange, option, output_options, spec_values, switch
from distsetup.cli.output import emit, json_text, refuse_generated_problems
from distsetup.formats.fsdp import (
    BACKWARD_PREFETCH,
    DTYPE_NAMES,
    MIXED_PRECISION,
    SHARDING_STRATEGIES,
    STATE_DICT_TYPES,
    TRANSFORMER,
    WRAP_POLICIES,
    FsdpSpec,
    build_fsdp_config,
)
from distsetup.formats.fsdp_rules import check_fsdp_spec, fsdp_problems
from distsetup.formats.runconfig import BUILTIN_BLOCK

DEFAULTS = FsdpSpec()  # each option's default is its field's


def _class_names(values: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated flags and comma lists alike: ('A,B', 'C') -> ('A', 'B', 'C')."""
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


@click.command(
    epilog="""\b
Examples:
  distsetup fsdp --sharding_strategy FULL_SHARD --mixed_precision BFLOAT16 --output config/fsdp_config.json
  distsetup fsdp --transformer_layer_cls_to_wrap LlamaDecoderLayer --cpu_offload -o fsdp_llama.json
  distsetup fsdp --fsdp_version 1 --backward_prefetch BACKWARD_PRE --use_orig_params -o fsdp1.json
"""
)
@option(
    "fsdp_version",
    type=click.Choice(["1", "2"]),
    default=str(DEFAULTS.fsdp_version),
    show_default=True,
    help="2 = fully_shard (FSDP2), 1 = FullyShardedDataParallel.",
)
@option(
    "sharding_strategy",
    type=click.Choice(SHARDING_STRATEGIES),
    default=DEFAULTS.sharding_strategy,
    show_default=True,
    help="What is sharded: FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2, HYBRID_* shard within a node.",
)
@option(
    "mixed_precision",
    type=click.Choice(list(MIXED_PRECISION)),
    default=DEFAULTS.mixed_precision,
    show_default=True,
    help="Parameter dtype for compute.",
)
@option(
    "reduce_dtype",
    type=click.Choice(DTYPE_NAMES),
    default=DEFAULTS.reduce_dtype,
    help="Gradient reduction dtype [float32].",
)
@option(
    "buffer_dtype",
    type=click.Choice(DTYPE_NAMES),
    default=DEFAULTS.buffer_dtype,
    help="Buffer dtype (FSDP1 only) [float32].",
)
@option(
    "auto_wrap_policy",
    type=click.Choice(WRAP_POLICIES),
    default=DEFAULTS.auto_wrap_policy,
    show_default=True,
    help="Which modules become FSDP units.",
)
@option(
    "transformer_layer_cls_to_wrap",
    multiple=True,
    metavar="CLASS[,CLASS]",
    help=f"Block class(es) to wrap; repeat or comma-separate. [{BUILTIN_BLOCK}, the built-in model's block]",
)
@option("min_num_params", type=IntegerRange(min=1), default=DEFAULTS.min_num_params, help="SIZE_BASED_WRAP threshold.")
@option(
    "state_dict_type",
    type=click.Choice(STATE_DICT_TYPES),
    default=DEFAULTS.state_dict_type,
    show_default=True,
    help="Checkpoint format.",
)
@option(
    "backward_prefetch",
    type=click.Choice(BACKWARD_PREFETCH),
    default=DEFAULTS.backward_prefetch,
    help="FSDP1 only [BACKWARD_PRE].",
)
@switch("forward_prefetch", default=DEFAULTS.forward_prefetch, help="FSDP1 only.")
@option(
    "cpu_offload", is_flag=True, default=DEFAULTS.cpu_offload, help="Keep parameters and gradients on CPU between uses."
)
@option(
    "activation_checkpointing",
    is_flag=True,
    default=DEFAULTS.activation_checkpointing,
    help="Recompute each block's activations in backward.",
)
@option(
    "cpu_ram_efficient_loading",
    is_flag=True,
    default=DEFAULTS.cpu_ram_efficient_loading,
    help="Only rank 0 loads weights; others get them.",
)
@switch(
    "sync_module_states",
    default=DEFAULTS.sync_module_states,
    help="FSDP1 only: broadcast rank 0's weights at wrap time.",
)
@switch("use_orig_params", default=DEFAULTS.use_orig_params, help="FSDP1 only [true].")
@output_options
@click.pass_context
def fsdp(ctx: click.Context, output, dry_run, **o):
    """Write an FSDP config (sharding, mixed precision, wrapping, state dict, offload)."""
    layers = _class_names(o["transformer_layer_cls_to_wrap"])
    if (
        not layers
        and o["auto_wrap_policy"] == TRANSFORMER
        and ctx.get_parameter_source("auto_wrap_policy") == click.core.ParameterSource.DEFAULT
    ):
        layers = (BUILTIN_BLOCK,)
        remarks = [
            f"Note: wrapping {BUILTIN_BLOCK}, the block of distsetup's built-in model; for a Hugging Face model give "
            "--transformer_layer_cls_to_wrap (e.g. LlamaDecoderLayer): Accelerate and the HF Trainer stop where the "
            "model has no such class."
        ]
    else:
        remarks = []
    made: dict[str, Any] = {"fsdp_version": int(o["fsdp_version"]), "transformer_layer_cls_to_wrap": layers}
    spec = FsdpSpec(**spec_values(FsdpSpec, o, besides=tuple(made)), **made)
    warnings = check_fsdp_spec(spec)
    config = build_fsdp_config(spec)
    refuse_generated_problems(fsdp_problems(config))
    emit(
        json_text(config),
        output,
        dry_run,
        next_step=f"distsetup launcher --use_fsdp --fsdp_config {shlex.quote(str(output))}",
        remarks=[f"Warning: {w}" for w in warnings] + remarks,
        kind="fsdp",
    )

"""`distsetup fsdp`: write an FSDP config with Accelerate's key names."""

import click

from distsetup.cli.options import option, output_options, switch
from distsetup.cli.output import emit, json_text, refuse_generated_problems
from distsetup.formats.fsdp import (
    BACKWARD_PREFETCH,
    DTYPES,
    MIXED_PRECISION,
    SHARDING_STRATEGIES,
    STATE_DICT_TYPES,
    WRAP_POLICIES,
    FsdpSpec,
    build_fsdp_config,
    check_fsdp_spec,
    fsdp_problems,
)


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
    default="2",
    show_default=True,
    help="2 = fully_shard (FSDP2), 1 = FullyShardedDataParallel.",
)
@option(
    "sharding_strategy",
    type=click.Choice(SHARDING_STRATEGIES),
    default="FULL_SHARD",
    show_default=True,
    help="What is sharded: FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2, HYBRID_* shard within a node.",
)
@option(
    "mixed_precision",
    type=click.Choice(list(MIXED_PRECISION)),
    default="no",
    show_default=True,
    help="Parameter dtype for compute.",
)
@option("reduce_dtype", type=click.Choice(DTYPES), help="Gradient reduction dtype [float32].")
@option("buffer_dtype", type=click.Choice(DTYPES), help="Buffer dtype (FSDP1 only) [float32].")
@option(
    "auto_wrap_policy",
    type=click.Choice(WRAP_POLICIES),
    default="TRANSFORMER_BASED_WRAP",
    show_default=True,
    help="Which modules become FSDP units.",
)
@option(
    "transformer_layer_cls_to_wrap",
    multiple=True,
    metavar="CLASS[,CLASS]",
    help="Block class(es) to wrap; repeat or comma-separate. [Block, the built-in model's block]",
)
@option("min_num_params", type=click.IntRange(min=1), help="SIZE_BASED_WRAP threshold.")
@option(
    "state_dict_type",
    type=click.Choice(STATE_DICT_TYPES),
    default="SHARDED_STATE_DICT",
    show_default=True,
    help="Checkpoint format.",
)
@option("backward_prefetch", type=click.Choice(BACKWARD_PREFETCH), help="FSDP1 only [BACKWARD_PRE].")
@switch("forward_prefetch", default=None, help="FSDP1 only.")
@option("cpu_offload", is_flag=True, help="Keep parameters and gradients on CPU between uses.")
@option("activation_checkpointing", is_flag=True, help="Recompute each block's activations in backward.")
@option("cpu_ram_efficient_loading", is_flag=True, help="Only rank 0 loads weights; others get them.")
@switch("sync_module_states", default=None, help="FSDP1 only: broadcast rank 0's weights at wrap time.")
@switch("use_orig_params", default=None, help="FSDP1 only [true].")
@output_options
@click.pass_context
def fsdp(ctx: click.Context, output, dry_run, **o):
    """Write an FSDP config (sharding, mixed precision, wrapping, state dict, offload)."""
    layers = _class_names(o["transformer_layer_cls_to_wrap"])
    if (
        not layers
        and o["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        and ctx.get_parameter_source("auto_wrap_policy") == click.core.ParameterSource.DEFAULT
    ):
        layers = ("Block",)
    spec = FsdpSpec(
        fsdp_version=int(o["fsdp_version"]),
        sharding_strategy=o["sharding_strategy"],
        mixed_precision=o["mixed_precision"],
        reduce_dtype=o["reduce_dtype"],
        buffer_dtype=o["buffer_dtype"],
        auto_wrap_policy=o["auto_wrap_policy"],
        transformer_layer_cls_to_wrap=layers,
        min_num_params=o["min_num_params"],
        state_dict_type=o["state_dict_type"],
        backward_prefetch=o["backward_prefetch"],
        forward_prefetch=o["forward_prefetch"],
        cpu_offload=o["cpu_offload"],
        activation_checkpointing=o["activation_checkpointing"],
        cpu_ram_efficient_loading=o["cpu_ram_efficient_loading"],
        sync_module_states=o["sync_module_states"],
        use_orig_params=o["use_orig_params"],
    )
    warnings = check_fsdp_spec(spec)
    config = build_fsdp_config(spec)
    refuse_generated_problems(fsdp_problems(config))
    emit(
        json_text(config),
        output,
        dry_run,
        next_step=f"distsetup launcher --use_fsdp --fsdp_config {output}",
        remarks=[f"Warning: {w}" for w in warnings],
    )

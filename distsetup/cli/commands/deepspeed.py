"""`distsetup deepspeed`: write a DeepSpeed JSON config that DeepSpeed accepts."""

import math
import shlex
from dataclasses import replace
from typing import Any

import click

from distsetup.cli.options import (
    IntegerRange,
    NumberRange,
    batch_options,
    chosen_precision,
    option,
    output_options,
    positive,
    spec_values,
    switch,
    world_options,
)
from distsetup.cli.output import emit, json_text, refuse_generated_problems
from distsetup.errors import DistsetupError
from distsetup.formats.batch import resolve_batch, world_size_from
from distsetup.formats.deepspeed import (
    DEFAULT_LR,
    OPTIMIZERS,
    PRESETS,
    SCHEDULERS,
    DeepSpeedSpec,
    OptimizerSpec,
    SchedulerSpec,
    build_deepspeed_config,
)
from distsetup.formats.deepspeed_notes import deepspeed_notes
from distsetup.formats.deepspeed_rules import applies, check_spec, deepspeed_problems
from distsetup.formats.lr_scaling import SCALING_RULES, scaled_lr

OFFLOAD = click.Choice(["cpu", "nvme"])
BYTES = IntegerRange(min=1)
DEFAULTS = DeepSpeedSpec()  # each option's default is its field's


@click.command(
    epilog="""\b
Examples:
  distsetup deepspeed --zero_stage 2 --offload_optimizer --bf16 --output config/ds_config.json
  distsetup deepspeed --preset zero3_offload --micro_batch_size 4 --world_size 16 -o ds.json
  distsetup deepspeed --zero_stage 3 --hf_auto -o ds_hf.json   # for TrainingArguments(deepspeed=...)
"""
)
@option("preset", type=click.Choice(sorted(PRESETS)), help="Start from a common recipe; flags override it.")
@option("zero_stage", type=IntegerRange(0, 3), default=DEFAULTS.zero_stage, show_default=True, help="ZeRO stage 0-3.")
@option(
    "offload_optimizer",
    type=OFFLOAD,
    is_flag=False,
    flag_value="cpu",
    help="Offload optimizer states (stages 1-3); bare flag = cpu.",
)
@option(
    "offload_param",
    type=OFFLOAD,
    is_flag=False,
    flag_value="cpu",
    help="Offload parameters (stage 3 only); bare flag = cpu.",
)
@option("nvme_path", help="Local NVMe folder, required for nvme offload.")
@switch("pin_memory", default=DEFAULTS.pin_memory, show_default=True, help="Pin offloaded CPU memory (always written).")
@option("bf16", is_flag=True, help="bfloat16 mixed precision.")
@option("fp16", is_flag=True, help="float16 mixed precision with dynamic loss scaling.")
@batch_options
@world_options
@option("gradient_clipping", type=NumberRange(min=0), help="Clip the gradient norm [1.0].")
@switch("overlap_comm", default=DEFAULTS.overlap_comm, help="Overlap gradient reduction with backward.")
@switch(
    "contiguous_gradients", default=DEFAULTS.contiguous_gradients, help="Copy gradients into one buffer as produced."
)
@option("reduce_bucket_size", type=BYTES, help="Elements reduced at once.")
@option("allgather_bucket_size", type=BYTES, help="Elements all-gathered at once (stages 1-2).")
@option("stage3_prefetch_bucket_size", type=BYTES, help="Stage 3: parameters prefetched ahead.")
@option(
    "stage3_param_persistence_threshold",
    type=IntegerRange(min=0),
    help="Stage 3: parameters smaller than this stay unpartitioned.",
)
@option("stage3_max_live_parameters", type=BYTES, help="Stage 3: parameters resident at once per GPU.")
@option(
    "stage3_max_reuse_distance",
    type=BYTES,
    help="Stage 3: a gathered parameter used again within this many parameters stays gathered.",
)
@option("sub_group_size", type=BYTES, help="Stage 3: parameters of a partition the optimizer steps at once.")
@option(
    "hidden_size",
    type=IntegerRange(min=1),
    help="The model's hidden size: the buffer sizes not given are sized from it (as HF's auto does, and the trainer "
    "where DeepSpeed's own leave no room).",
)
@switch(
    "stage3_gather_16bit_weights_on_model_save",
    default=DEFAULTS.stage3_gather_16bit_weights_on_model_save,
    help="Stage 3: gather full 16-bit weights when saving the model [on: the HF Trainer saves no weights without it].",
)
@option(
    "optimizer",
    type=click.Choice(OPTIMIZERS),
    default=DEFAULTS.optimizer.name,
    show_default=True,
    help="Optimizer block; none lets the training script bring its own.",
)
@option("lr", type=NumberRange(min=0, min_open=True), help="Learning rate [3e-4].")
@option(
    "scale_lr",
    type=click.Choice(SCALING_RULES),
    help="Scale --lr from --base_batch_size to the global batch (needs the world size).",
)
@option("base_batch_size", type=positive, help="Global batch size that --lr was tuned for.")
@option("betas", type=(float, float), help="Adam betas, e.g. --betas 0.9 0.95.")
@option("eps", type=NumberRange(min=0, min_open=True), help="Adam epsilon [1e-8].")
@option("weight_decay", type=NumberRange(min=0), help="Weight decay [0.01].")
@option(
    "scheduler",
    type=click.Choice(SCHEDULERS),
    default=DEFAULTS.scheduler.name,
    show_default=True,
    help="LR schedule block.",
)
@option("warmup_num_steps", type=IntegerRange(min=0), help="Warmup steps [100].")
@option("total_num_steps", type=positive, help="Total steps (WarmupDecayLR, WarmupCosineLR).")
@option("warmup_min_lr", type=NumberRange(min=0), help="Learning rate at the start of warmup [0].")
@option("steps_per_print", type=positive, help="DeepSpeed's progress print interval [100].")
@option("wall_clock_breakdown", is_flag=True, default=DEFAULTS.wall_clock_breakdown, help="Time forward/backward/step.")
@option("hf_auto", is_flag=True, default=DEFAULTS.hf_auto, help='Write "auto" where the HF Trainer fills values in.')
@output_options
@click.pass_context
def deepspeed(ctx: click.Context, output, dry_run, **opts):
    """Write a DeepSpeed config (ZeRO 0-3, offload, precision, batch sizes, optimizer)."""
    if opts["preset"]:
        given = {n for n in opts if ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT}
        preset = PRESETS[opts["preset"]]
        stage = opts["zero_stage"] if "zero_stage" in given else preset["zero_stage"]
        # A preset's values for its own stage give way to the stage the user chose.
        opts.update({n: v for n, v in preset.items() if n not in given and applies(n, stage)})
    spec = spec_from_options(opts)
    if opts["scale_lr"] and spec.hf_auto:
        raise DistsetupError(
            "--scale_lr cannot be combined with --hf_auto: the HF Trainer checks the file's lr "
            "against TrainingArguments.learning_rate and refuses a scaled one.",
            "drop --scale_lr and pass the scaled rate as TrainingArguments(learning_rate=...).",
        )
    if opts["scale_lr"]:
        spec = scale_spec_lr(spec, opts["scale_lr"], opts["base_batch_size"])
    elif opts["base_batch_size"]:
        raise DistsetupError("--base_batch_size is only used with --scale_lr.", "add --scale_lr linear (or sqrt).")
    warnings = check_spec(spec)
    config = build_deepspeed_config(spec)
    refuse_generated_problems(deepspeed_problems(config, spec.batch.world_size, hf=spec.hf_auto))
    next_step = (
        f"TrainingArguments(deepspeed={output!r}, ...) in your HF Trainer script"
        if spec.hf_auto
        else f"distsetup launcher --use_deepspeed --deepspeed_config {shlex.quote(str(output))}"
    )
    notes = [] if spec.hf_auto else deepspeed_notes(config)
    remarks = [f"Warning: {w}" for w in warnings] + [f"Note: {n}" for n in notes]
    emit(json_text(config), output, dry_run, next_step=next_step, remarks=remarks, kind="deepspeed")


def scale_spec_lr(spec: DeepSpeedSpec, rule: str, base_batch: int | None) -> DeepSpeedSpec:
    """The spec with its lr scaled from `base_batch` to the global batch; says so on stderr."""
    if base_batch is None:
        raise DistsetupError(
            f"--scale_lr {rule} needs --base_batch_size.",
            "add --base_batch_size B, the global batch your --lr was tuned for.",
        )
    if spec.batch.train_batch is None:
        raise DistsetupError(
            f"--scale_lr {rule} needs the global batch, so the world size must be known.",
            "add --world_size N (or --num_nodes and --num_gpus_per_node).",
        )
    if spec.hf_auto and spec.optimizer.lr is None:
        raise DistsetupError(
            "--scale_lr with --hf_auto needs --lr (the HF Trainer would fill lr unscaled).",
            "add --lr, the learning rate tuned at --base_batch_size.",
        )
    lr = spec.optimizer.lr if spec.optimizer.lr is not None else DEFAULT_LR
    new_lr = scaled_lr(lr, spec.batch.train_batch, base_batch, rule)
    if not math.isfinite(new_lr):
        raise DistsetupError(
            f"--lr {lr:g} scaled {rule} to global batch {spec.batch.train_batch} is no finite number.",
            "give the learning rate your model was tuned with.",
        )
    click.echo(
        f"lr {lr:g} scaled {rule} from base batch {base_batch} to global batch {spec.batch.train_batch}: "
        f"writing lr {new_lr:.6g}",
        err=True,
    )
    return replace(spec, optimizer=replace(spec.optimizer, lr=new_lr))


def spec_from_options(o: dict) -> DeepSpeedSpec:
    """The spec of the options: each field from the option of its name; precision, batch, optimizer and scheduler
    from the options that make them up."""
    precision = chosen_precision(o["bf16"], o["fp16"]) or (None if o["hf_auto"] else "fp32")
    world_size = world_size_from(o["world_size"], o["num_nodes"], o["num_gpus_per_node"])
    batch = resolve_batch(o["micro_batch_size"], o["gradient_accumulation_steps"], o["train_batch_size"], world_size)
    made: dict[str, Any] = {
        "precision": precision,
        "batch": batch,
        "optimizer": OptimizerSpec(name=o["optimizer"], **spec_values(OptimizerSpec, o, besides=("name",))),
        "scheduler": SchedulerSpec(name=o["scheduler"], **spec_values(SchedulerSpec, o, besides=("name",))),
    }
    return DeepSpeedSpec(**spec_values(DeepSpeedSpec, o, besides=tuple(made)), **made)

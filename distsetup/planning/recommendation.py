"""The DeepSpeed or FSDP file a plan recommends, built by the same builders as `distsetup deepspeed|fsdp`,
and the command line that writes it."""

import shlex

from distsetup.formats.batch import resolve_batch
from distsetup.formats.deepspeed import DeepSpeedSpec, OptimizerSpec, build_deepspeed_config
from distsetup.formats.deepspeed_rules import check_spec
from distsetup.formats.default_paths import BACKEND_FILE_NAMES, CONFIG_FOLDER
from distsetup.formats.fsdp import FLAG_FOR_PRECISION, FsdpSpec, build_fsdp_config
from distsetup.formats.fsdp_rules import check_fsdp_spec
from distsetup.formats.runconfig import TrainingConfig
from distsetup.planning.estimates import BY_KEY, Estimate
from distsetup.planning.planner import Plan


def recommended_files(
    result: Plan, optimizer: OptimizerSpec | None = None, folder: str = CONFIG_FOLDER
) -> tuple[str | None, dict, list[str]]:
    """The exact `distsetup deepspeed|fsdp` command, the config it writes (via the same builders) and the warnings
    that command prints about it. `optimizer`: the run config's lr, betas and weight decay, which a DeepSpeed file
    then carries too (its own defaults would override them: lr 3e-4 where the run config trains at 1e-3).
    `folder`: where the command writes it (plan --write's)."""
    choice, micro, accumulation = result.choice, result.micro_batch, result.accumulation
    if choice is None or micro is None or accumulation is None:  # no recommendation: all three are None
        return None, {}, []
    s, precision = BY_KEY[choice.strategy], result.workload.precision
    world = result.hardware.world_size
    if s.framework == "ddp":
        return None, {}, []
    if s.framework == "deepspeed":
        # the file leaves ZeRO's buffers unset where DeepSpeed's own sizes fit, as the estimate counts them
        hidden_size = None if choice.keeps_deepspeed_sizes else result.model.hidden_size
        args = deepspeed_args(choice, micro, accumulation, precision, world, hidden_size) + optimizer_args(optimizer)
        ds_spec = DeepSpeedSpec(
            zero_stage=s.zero_stage,
            offload_optimizer="cpu" if s.offload_optimizer else None,
            offload_param="cpu" if s.offload_param else None,
            precision=precision,
            batch=resolve_batch(micro, accumulation, None, world),
            hidden_size=hidden_size,
            optimizer=optimizer or OptimizerSpec(),
        )
        warnings = check_spec(ds_spec)
        name, config = BACKEND_FILE_NAMES["deepspeed"], build_deepspeed_config(ds_spec)
        command = ["distsetup", "deepspeed", *args, "--output", f"{folder}/{name}"]
    else:
        fsdp_spec = FsdpSpec(
            sharding_strategy=s.fsdp_sharding,
            transformer_layer_cls_to_wrap=(result.model.layer_cls,),
            mixed_precision=FLAG_FOR_PRECISION[precision],
            activation_checkpointing=choice.activation_checkpointing,
        )
        warnings = check_fsdp_spec(fsdp_spec)
        name, config = BACKEND_FILE_NAMES["fsdp"], build_fsdp_config(fsdp_spec)
        command = [
            "distsetup",
            "fsdp",
            *fsdp_args(choice, precision, result.model.layer_cls),
            "--output",
            f"{folder}/{name}",
        ]
    return shlex.join(command), {name: config}, warnings


def deepspeed_args(
    choice: Estimate, micro: int, accumulation: int, precision: str, world_size: int, hidden_size: int | None
) -> list[str]:
    """The `distsetup deepspeed` arguments for a DeepSpeed recommendation (its buffers sized for `hidden_size`)."""
    s = BY_KEY[choice.strategy]
    args = ["--zero_stage", str(s.zero_stage)]
    if s.offload_optimizer:
        args.append("--offload_optimizer")
    if s.offload_param:
        args.append("--offload_param")
    if precision != "fp32":
        args.append(f"--{precision}")
    if hidden_size:
        args += ["--hidden_size", str(hidden_size)]
    return args + [
        "--micro_batch_size",
        str(micro),
        "--gradient_accumulation_steps",
        str(accumulation),
        "--world_size",
        str(world_size),
    ]


def run_config_optimizer(training: TrainingConfig) -> OptimizerSpec:
    """The AdamW settings of a run config's training section, for the DeepSpeed file beside it."""
    return OptimizerSpec(
        lr=training.lr, betas=(training.betas[0], training.betas[1]), weight_decay=training.weight_decay
    )


def optimizer_args(optimizer: OptimizerSpec | None) -> list[str]:
    """The `distsetup deepspeed` arguments that write `optimizer`'s settings."""
    if optimizer is None:
        return []
    args = [] if optimizer.lr is None else ["--lr", str(optimizer.lr)]  # str: the float again when read back
    if optimizer.betas is not None:
        args += ["--betas", *(str(beta) for beta in optimizer.betas)]
    return args + ([] if optimizer.weight_decay is None else ["--weight_decay", str(optimizer.weight_decay)])


def fsdp_args(choice: Estimate, precision: str, layer_cls: str) -> list[str]:
    """The `distsetup fsdp` arguments for an FSDP recommendation."""
    s = BY_KEY[choice.strategy]
    args = ["--sharding_strategy", s.fsdp_sharding, "--transformer_layer_cls_to_wrap", layer_cls]
    if precision != "fp32":
        args += ["--mixed_precision", FLAG_FOR_PRECISION[precision]]
    if choice.activation_checkpointing:
        args.append("--activation_checkpointing")
    return args

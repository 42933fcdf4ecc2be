"""Building a DeepSpeed config dict from a frozen spec: pure, no Click, no disk, no DeepSpeed import."""

from dataclasses import dataclass, field

from distsetup.batch import BatchSizes
from distsetup.errors import DistsetupError

AUTO = "auto"
DEFAULT_LR = 3e-4
SCHEDULERS = ("none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
OPTIMIZERS = ("AdamW", "Adam", "none")
FP16_LOSS_SCALING = {"loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1}


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "AdamW"
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None


@dataclass(frozen=True)
class SchedulerSpec:
    name: str = "none"
    warmup_num_steps: int | None = None
    total_num_steps: int | None = None
    warmup_min_lr: float | None = None


@dataclass(frozen=True)
class Stage3Spec:
    prefetch_bucket_size: int | None = None
    param_persistence_threshold: int | None = None
    max_live_parameters: int | None = None
    gather_16bit_weights_on_model_save: bool | None = None


@dataclass(frozen=True)
class DeepSpeedSpec:
    """Everything `distsetup deepspeed` was asked for, validated field by field by Click."""

    zero_stage: int = 0
    offload_optimizer: str | None = None          # None | "cpu" | "nvme"
    offload_param: str | None = None
    nvme_path: str | None = None
    pin_memory: bool = True
    precision: str = "fp32"                       # "fp32" | "bf16" | "fp16"; None under hf_auto = "auto"
    batch: BatchSizes = BatchSizes(None, None, None, None)
    gradient_clipping: float | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    stage3: Stage3Spec = field(default_factory=Stage3Spec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    hf_auto: bool = False


def check_spec(spec: DeepSpeedSpec) -> list[str]:
    """Reject combinations DeepSpeed would ignore silently; return warnings for ones it bends."""
    if spec.offload_param and spec.zero_stage != 3:
        raise DistsetupError(f"--offload_param needs --zero_stage 3 (got {spec.zero_stage}); "
                             "DeepSpeed ignores offload_param below stage 3.",
                             "use --zero_stage 3, or drop --offload_param.")
    if spec.offload_optimizer and spec.zero_stage == 0:
        raise DistsetupError("--offload_optimizer needs --zero_stage 1, 2 or 3.",
                             "add --zero_stage 2 (the usual choice for optimizer offload).")
    if spec.stage3 != Stage3Spec() and spec.zero_stage != 3:
        raise DistsetupError("the stage-3 options (--stage3_*) mean nothing below --zero_stage 3.",
                             "use --zero_stage 3, or drop them.")
    nvme = "nvme" in (spec.offload_optimizer, spec.offload_param)
    if nvme and not spec.nvme_path:
        raise DistsetupError("offloading to nvme needs --nvme_path.",
                             "add --nvme_path /local/nvme (a fast local disk on every node).")
    if spec.nvme_path and not nvme:
        raise DistsetupError("--nvme_path is only used with --offload_optimizer nvme or --offload_param nvme.",
                             "drop --nvme_path, or offload to nvme.")
    needs_total = spec.scheduler.name in ("WarmupDecayLR", "WarmupCosineLR")
    if needs_total and spec.scheduler.total_num_steps is None and not spec.hf_auto:
        raise DistsetupError(f"--scheduler {spec.scheduler.name} needs --total_num_steps.",
                             "add --total_num_steps N (the number of optimizer steps of the run).")
    warnings = []
    if spec.offload_optimizer == "nvme" and spec.zero_stage in (1, 2):
        warnings.append(f"at ZeRO stage {spec.zero_stage} DeepSpeed keeps optimizer states in CPU memory; "
                        "it swaps them to NVMe only at stage 3.")
    return warnings


def build_deepspeed_config(spec: DeepSpeedSpec) -> dict:
    """The DeepSpeed config dict for `spec` (call check_spec first)."""
    auto = AUTO if spec.hf_auto else None
    config: dict = {}
    _set_batch(config, spec.batch, auto)
    config["gradient_clipping"] = _pick(spec.gradient_clipping, auto, 1.0)
    config.update(_precision(spec.precision, auto))
    config["zero_optimization"] = _zero(spec, auto)
    lr = _pick(spec.optimizer.lr, auto, DEFAULT_LR)
    if spec.optimizer.name != "none":
        config["optimizer"] = _optimizer(spec.optimizer, lr, auto)
    if spec.scheduler.name != "none":
        config["scheduler"] = _scheduler(spec.scheduler, lr, auto)
    config["steps_per_print"] = spec.steps_per_print if spec.steps_per_print is not None else 100
    config["wall_clock_breakdown"] = spec.wall_clock_breakdown
    return config


def _pick(value, auto, default=None):
    """The user's value, else "auto" under --hf_auto, else our default."""
    if value is not None:
        return value
    return auto if auto is not None else default


def _set_batch(config: dict, batch: BatchSizes, auto) -> None:
    if auto is None:
        micro = batch.micro if batch.micro is not None or batch.train_batch is not None else 1
        accumulation = batch.accumulation if batch.accumulation is not None or batch.train_batch is not None else 1
    else:
        micro, accumulation = _pick(batch.micro, auto), _pick(batch.accumulation, auto)
    for key, value in (("train_batch_size", _pick(batch.train_batch, auto)),
                       ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accumulation)):
        if value is not None:
            config[key] = value


def _precision(precision: str | None, auto) -> dict:
    if precision is None and auto is not None:
        return {"fp16": {"enabled": auto, **FP16_LOSS_SCALING}, "bf16": {"enabled": auto}}
    fp16 = {"enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.update(FP16_LOSS_SCALING)
    return {"fp16": fp16, "bf16": {"enabled": precision == "bf16"}}


def _offload(device: str, spec: DeepSpeedSpec) -> dict:
    block = {"device": device, "pin_memory": spec.pin_memory}
    if device == "nvme":
        block["nvme_path"] = spec.nvme_path
    return block


def _zero(spec: DeepSpeedSpec, auto) -> dict:
    zero: dict = {"stage": spec.zero_stage}
    if spec.zero_stage == 0:
        return zero
    if spec.offload_optimizer:
        zero["offload_optimizer"] = _offload(spec.offload_optimizer, spec)
    if spec.offload_param:
        zero["offload_param"] = _offload(spec.offload_param, spec)
    for key in ("overlap_comm", "contiguous_gradients", "allgather_bucket_size"):
        if getattr(spec, key) is not None:
            zero[key] = getattr(spec, key)
    reduce_bucket = _pick(spec.reduce_bucket_size, auto)
    if reduce_bucket is not None:
        zero["reduce_bucket_size"] = reduce_bucket
    if spec.zero_stage == 3:
        s3 = spec.stage3
        for key, value in (("stage3_prefetch_bucket_size", _pick(s3.prefetch_bucket_size, auto)),
                           ("stage3_param_persistence_threshold", _pick(s3.param_persistence_threshold, auto)),
                           ("stage3_max_live_parameters", s3.max_live_parameters),
                           ("stage3_gather_16bit_weights_on_model_save", s3.gather_16bit_weights_on_model_save)):
            if value is not None:
                zero[key] = value
    return zero


def _optimizer(opt: OptimizerSpec, lr, auto) -> dict:
    params = {"lr": lr,
              "betas": list(opt.betas) if opt.betas else _pick(None, auto, [0.9, 0.999]),
              "eps": _pick(opt.eps, auto, 1e-8),
              "weight_decay": _pick(opt.weight_decay, auto, 0.01)}
    return {"type": opt.name, "params": params}


def _scheduler(sched: SchedulerSpec, lr, auto) -> dict:
    warmup = _pick(sched.warmup_num_steps, auto, 100)
    if sched.name == "WarmupCosineLR":
        params = {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "warmup_num_steps": warmup,
                  "total_num_steps": _pick(sched.total_num_steps, auto)}
    else:
        params = {"warmup_min_lr": _pick(sched.warmup_min_lr, auto, 0.0),
                  "warmup_max_lr": lr,
                  "warmup_num_steps": warmup}
        if sched.name == "WarmupDecayLR":
            params["total_num_steps"] = _pick(sched.total_num_steps, auto)
    return {"type": sched.name, "params": params}


# Common recipes: defaults for `distsetup deepspeed --preset NAME`; explicit flags still win.
# Precision is left to --bf16/--fp16: the right choice depends on the GPU.
_ZERO_COMMON = {"overlap_comm": True, "contiguous_gradients": True,
                "reduce_bucket_size": 500_000_000}
PRESETS = {
    "zero0": {"zero_stage": 0},
    "zero1": {"zero_stage": 1, **_ZERO_COMMON},
    "zero2": {"zero_stage": 2, **_ZERO_COMMON, "allgather_bucket_size": 500_000_000},
    "zero2_offload": {"zero_stage": 2, **_ZERO_COMMON, "allgather_bucket_size": 500_000_000,
                      "offload_optimizer": "cpu"},
    "zero3": {"zero_stage": 3, **_ZERO_COMMON, "stage3_gather_16bit_weights_on_model_save": True},
    "zero3_offload": {"zero_stage": 3, **_ZERO_COMMON, "stage3_gather_16bit_weights_on_model_save": True,
                      "offload_optimizer": "cpu", "offload_param": "cpu"},
}

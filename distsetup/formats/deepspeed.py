"""The DeepSpeed file as one typed model, DeepSpeedSpec: built from the flags of `distsetup deepspeed`, read from a
file (`DeepSpeedSpec.from_dict`) or from an Accelerate config's deepspeed_config block (`from_accelerate`), and
written (`to_dict`, `build_deepspeed_config`); with the readers of a file's values and the command's presets. Its
rules are in deepspeed_rules. Pure: no Click, no disk, no DeepSpeed import."""

from dataclasses import dataclass, field
from typing import Any

from distsetup.formats.batch import FILE_KEYS, BatchSizes, complete_batch

AUTO = "auto"
DEFAULT_LR = 3e-4
DEFAULT_WARMUP_STEPS = 100
SCHEDULERS = ("none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
OPTIMIZERS = ("AdamW", "Adam", "none")
FP16_LOSS_SCALING = {
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
STAGE_NUMBERS = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# The ZeRO stages at which each option means something; DeepSpeed silently ignores it at the others.
STAGES = {
    "offload_optimizer": (1, 2, 3),
    "offload_param": (3,),
    "overlap_comm": (1, 2, 3),
    "contiguous_gradients": (1, 2, 3),
    "reduce_bucket_size": (1, 2, 3),
    "allgather_bucket_size": (1, 2),
    "stage3_prefetch_bucket_size": (3,),
    "stage3_param_persistence_threshold": (3,),
    "stage3_max_live_parameters": (3,),
    "stage3_max_reuse_distance": (3,),
    "sub_group_size": (3,),
    "stage3_gather_16bit_weights_on_model_save": (3,),
}

# ZeRO's buffers sized from the model's hidden size h, the first three as the HF integration's "auto" sizes them
# (transformers' integrations/deepspeed.py): key -> (factor, power of h). DeepSpeed's own defaults are sizes for no
# model in particular: a reduce bucket of 5e8 elements (2 GB in fp32 on every rank), a prefetch bucket of 5e7, and
# 1e9 elements both for the parameters kept gathered and for the distance within which a gathered layer is kept for
# its next use, which keeps every layer gathered from its forward to its backward: the whole model, on each rank.
# A transformer block has about 12 h^2 parameters: gathered, at most the block running and the one prefetched; kept
# for the backward, only the last block, as FSDP2 keeps its last unit. The optimizer steps a rank's partition a
# sub-group at a time, copying each sub-group's gradients into one flat tensor first (4 bytes a parameter / W in fp32
# with DeepSpeed's 1e9): a block's worth at a time.
MODEL_SIZED = {
    "reduce_bucket_size": (1.0, 2),
    "stage3_prefetch_bucket_size": (0.9, 2),
    "stage3_param_persistence_threshold": (10.0, 1),
    "stage3_max_live_parameters": (24.0, 2),
    "stage3_max_reuse_distance": (12.0, 2),
    "sub_group_size": (12.0, 2),
}

# DeepSpeed's own sizes of the same buffers (its ZeRO config's defaults): what a file that leaves them unset means to
# DeepSpeed and the HF Trainer
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
# Those the trainer keeps at DeepSpeed's sizes where a rank has room for them (planning.estimates): not
# sub_group_size, which shapes a ZeRO-3 checkpoint's optimizer partitions, so that a run resumes its checkpoint on a
# machine that decided otherwise
SIZED_BY_ROOM = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


def model_sized(key: str, hidden_size: int) -> int:
    """The size of ZeRO buffer `key` (MODEL_SIZED) for a model of hidden size `hidden_size`."""
    factor, power = MODEL_SIZED[key]
    return int(factor * hidden_size**power)


def unset_sizes(zero: dict, hidden_size: int) -> dict[str, int]:
    """The model-sized values of the buffers a zero_optimization block leaves unset, at the stages they mean
    something at."""
    stage = zero.get("stage", 0)
    return {key: model_sized(key, hidden_size) for key in MODEL_SIZED if key not in zero and stage in STAGES[key]}


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
class DeepSpeedSpec:
    """Everything `distsetup deepspeed` was asked for, validated field by field by Click."""

    zero_stage: int = 0
    offload_optimizer: str | None = None  # None | "cpu" | "nvme"
    offload_param: str | None = None
    nvme_path: str | None = None  # the flag's, for both blocks
    nvme_paths: tuple[tuple[str, str], ...] = ()  # a file's (or Accelerate's): each block's own, where it has one
    pin_memory: bool = True
    precision: str | None = "fp32"  # "fp32" | "bf16" | "fp16"; None under hf_auto = "auto"
    batch: BatchSizes = BatchSizes(None, None, None, None)
    gradient_clipping: float | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int | None = None
    stage3_max_live_parameters: int | None = None
    stage3_max_reuse_distance: int | None = None
    sub_group_size: int | None = None
    hidden_size: int | None = None  # the model's: the buffers left unset are sized from it (MODEL_SIZED)
    stage3_gather_16bit_weights_on_model_save: bool | None = None
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    hf_auto: bool = False
    other_zero_options: tuple[str, ...] = ()  # a file's zero_optimization keys that no flag sets (stage rules only)

    @classmethod
    def from_dict(cls, config: dict) -> "DeepSpeedSpec":
        """What the rules read of a DeepSpeed file (the values a schema problem makes unreadable left out)."""
        zero = section_of(config, "zero_optimization")
        devices = {block: offload_device(config, block) for block in ("offload_optimizer", "offload_param")}
        paths = {b: section_of(zero, b).get("nvme_path") for b, device in devices.items() if device == "nvme"}
        set_keys = [key for key, value in zero.items() if key != "stage" and key not in devices and _is_setting(value)]
        options = {key: zero[key] for key in set_keys if key in STAGES}
        return cls(
            zero_stage=zero_stage_of(config),
            offload_optimizer=None if devices["offload_optimizer"] == "none" else devices["offload_optimizer"],
            offload_param=None if devices["offload_param"] == "none" else devices["offload_param"],
            nvme_paths=tuple((block, path) for block, path in paths.items() if path),
            precision=precision_of(config),
            other_zero_options=tuple(key for key in set_keys if key not in STAGES),
            **options,
        )

    @classmethod
    def from_accelerate(cls, block: dict, mixed_precision) -> "DeepSpeedSpec":
        """What the rules read of an Accelerate config's deepspeed_config block and its top-level mixed_precision."""
        stage = accelerate_zero_stage(block.get("zero_stage"))
        devices = {
            option: device if device in OFFLOAD_DEVICES and device != "none" else None
            for option in ("offload_optimizer", "offload_param")
            for device in [block.get(f"{option}_device")]
        }
        paths = {option: block.get(f"{option}_nvme_path") for option, device in devices.items() if device == "nvme"}
        return cls(
            zero_stage=2 if stage is None else stage,  # Accelerate's default
            offload_optimizer=devices["offload_optimizer"],
            offload_param=devices["offload_param"],
            nvme_paths=tuple((option, path) for option, path in paths.items() if path),
            precision={"fp16": "fp16", "bf16": "bf16"}.get(mixed_precision, "fp32"),
        )

    def to_dict(self) -> dict:
        """The DeepSpeed file for this spec (call check_spec first)."""
        return build_deepspeed_config(self)

    def nvme_path_of(self, option: str) -> str | None:
        """Where `option` (offload_optimizer, offload_param) offloads to nvme: its own path, else the flag's."""
        return dict(self.nvme_paths).get(option) or self.nvme_path

    def given(self) -> set[str]:
        """The zero_optimization options set (the rules about a stage read only these)."""
        return {option for option in STAGES if getattr(self, option) is not None} | set(self.other_zero_options)


def _is_setting(value) -> bool:
    return value is not None and value != AUTO


# The file's precision sections; DeepSpeed still reads the old spelling "bfloat16" for "bf16".
PRECISION_SECTIONS = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def enabled_precisions(config: dict) -> set[str]:
    """The 16-bit precisions a DeepSpeed file enables (more than one is a problem)."""
    return {p for key, p in PRECISION_SECTIONS.items() if section_of(config, key).get("enabled") is True}


def precision_of(config: dict) -> str:
    """The training precision a DeepSpeed file asks for: bf16, fp16 or fp32."""
    enabled = enabled_precisions(config)
    return "bf16" if "bf16" in enabled else "fp16" if "fp16" in enabled else "fp32"


def accelerate_zero_stage(value) -> int | None:
    """The ZeRO stage `accelerate launch` takes from an Accelerate config's deepspeed_config.zero_stage: it passes
    the value on as a string, which its DeepSpeedPlugin reads with int() (so "3" is stage 3, as 3 is); None where
    that fails or gives no stage."""
    try:
        stage = int(str(value))
    except ValueError:
        return None
    return stage if stage in STAGE_NUMBERS else None


def zero_stage_of(config: dict) -> int:
    """The ZeRO stage DeepSpeed runs the file at; 0 where stage_as_read does not know it."""
    return stage_as_read(config) or 0


def stage_as_read(config: dict) -> int | None:
    """The ZeRO stage zero_optimization.stage gives: "2" as 2 (DeepSpeed's config model reads it so; the schema asks
    for the quotes to go); None where it is not known here ("auto": Accelerate's setting, 2 unless accelerate
    launch --zero_stage says another, said in a note) or no reader takes it (4, "two", true)."""
    value = section_of(config, "zero_optimization").get("stage", 0)
    if value == AUTO:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if value in STAGE_NUMBERS and not isinstance(value, bool) else None


def offload_device(config: dict, block: str) -> str:
    """Where zero_optimization.offload_optimizer / offload_param puts its states: none, cpu or nvme."""
    device = section_of(section_of(config, "zero_optimization"), block).get("device")
    return device if device in OFFLOAD_DEVICES else "none"


def batch_of(config: dict, world_size: int) -> BatchSizes:
    """The batch sizes DeepSpeed derives from the file at `world_size` (BatchMismatch where none fit)."""
    micro, accumulation, train = (
        positive_int_at(config, key) for key in (FILE_KEYS.micro, FILE_KEYS.accumulation, FILE_KEYS.train)
    )
    return complete_batch(micro, accumulation, train, world_size, FILE_KEYS)


def section_of(config: dict, key: str) -> dict:
    """config[key] when it is a dict, else {} (a wrong type is already a schema problem)."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def positive_int_at(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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
    """The batch values given (the missing third computed where the world size is known); none given, none
    written: a batch nobody chose would override the run config's (distsetup's trainer fills it from there)."""
    if auto is None:
        micro, accumulation = batch.micro, batch.accumulation
    else:
        micro, accumulation = _pick(batch.micro, auto), _pick(batch.accumulation, auto)
    for key, value in (
        ("train_batch_size", _pick(batch.train_batch, auto)),
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", accumulation),
    ):
        if value is not None:
            config[key] = value


def _precision(precision: str | None, auto) -> dict:
    if precision is None and auto is not None:
        return {"fp16": {"enabled": auto, **FP16_LOSS_SCALING}, "bf16": {"enabled": auto}}
    fp16: dict[str, bool | int] = {"enabled": precision == "fp16"}
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
    sizes_auto = None if spec.hidden_size else auto  # a hidden size given sizes them (unset_sizes), not "auto"
    reduce_bucket = _pick(spec.reduce_bucket_size, sizes_auto)
    if reduce_bucket is not None:
        zero["reduce_bucket_size"] = reduce_bucket
    if spec.zero_stage == 3:
        for key, value in (
            ("stage3_prefetch_bucket_size", _pick(spec.stage3_prefetch_bucket_size, sizes_auto)),
            ("stage3_param_persistence_threshold", _pick(spec.stage3_param_persistence_threshold, sizes_auto)),
            ("stage3_max_live_parameters", spec.stage3_max_live_parameters),
            ("stage3_max_reuse_distance", spec.stage3_max_reuse_distance),
            ("sub_group_size", spec.sub_group_size),
            # on unless refused: without it the HF Trainer and save_16bit_model save no weights at stage 3
            ("stage3_gather_16bit_weights_on_model_save", spec.stage3_gather_16bit_weights_on_model_save is not False),
        ):
            if value is not None:
                zero[key] = value
    if spec.hidden_size:
        zero.update(unset_sizes(zero, spec.hidden_size))
    return zero


def _optimizer(opt: OptimizerSpec, lr, auto) -> dict:
    params = {
        "lr": lr,
        "betas": list(opt.betas) if opt.betas else _pick(None, auto, [0.9, 0.999]),
        "eps": _pick(opt.eps, auto, 1e-8),
        "weight_decay": _pick(opt.weight_decay, auto, 0.01),
    }
    if opt.name == "Adam":
        params["adam_w_mode"] = False  # DeepSpeed's "Adam" is AdamW unless told otherwise
    return {"type": opt.name, "params": params}


def _scheduler(sched: SchedulerSpec, lr, auto) -> dict:
    warmup = _pick(sched.warmup_num_steps, auto, DEFAULT_WARMUP_STEPS)
    if sched.name == "WarmupCosineLR":
        params = {
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.1,
            "warmup_num_steps": warmup,
            "total_num_steps": _pick(sched.total_num_steps, auto),
            "warmup_type": "linear",
        }
    else:
        params = {
            "warmup_min_lr": _pick(sched.warmup_min_lr, auto, 0.0),
            "warmup_max_lr": lr,
            "warmup_num_steps": warmup,
            "warmup_type": "linear",
        }  # DeepSpeed's default is log
        if sched.name == "WarmupDecayLR":
            params["total_num_steps"] = _pick(sched.total_num_steps, auto)
    return {"type": sched.name, "params": params}


# Common recipes: defaults for `distsetup deepspeed --preset NAME`; explicit flags still win.
# Precision is left to --bf16/--fp16: the right choice depends on the GPU.
_ZERO_COMMON = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 500_000_000}


PRESETS: dict[str, dict[str, Any]] = {  # option name -> value, as the command's options hold them
    "zero0": {"zero_stage": 0},
    "zero1": {"zero_stage": 1, **_ZERO_COMMON},
    "zero2": {"zero_stage": 2, **_ZERO_COMMON, "allgather_bucket_size": 500_000_000},
    "zero2_offload": {
        "zero_stage": 2,
        **_ZERO_COMMON,
        "allgather_bucket_size": 500_000_000,
        "offload_optimizer": "cpu",
    },
    "zero3": {"zero_stage": 3, **_ZERO_COMMON, "stage3_gather_16bit_weights_on_model_save": True},
    "zero3_offload": {
        "zero_stage": 3,
        **_ZERO_COMMON,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": "cpu",
        "offload_param": "cpu",
    },
}

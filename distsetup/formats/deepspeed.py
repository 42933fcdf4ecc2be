"""The DeepSpeed file as one typed model, DeepSpeedSpec: built from the flags of `distsetup deepspeed`, read from a
file (`DeepSpeedSpec.from_dict`) or from an Accelerate config's deepspeed_config block (`from_accelerate`), written
(`to_dict`), and held to one list of rules (`violations`) said in flags, in the file's keys or in Accelerate's keys;
then what only a file can get wrong (the batch identity, "auto", the schema). Pure: no Click, no disk, no DeepSpeed
import."""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from distsetup.errors import DistsetupError
from distsetup.formats.batch import FILE_KEYS, BatchMismatch, BatchSizes, complete_batch
from distsetup.formats.problems import Problem, Violation, join_path, schema_problems

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
    nvme_path: str | None = None
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
        zero = _section(config, "zero_optimization")
        devices = {block: offload_device(config, block) for block in ("offload_optimizer", "offload_param")}
        paths = [_section(zero, b).get("nvme_path") for b, device in devices.items() if device == "nvme"]
        set_keys = [key for key, value in zero.items() if key != "stage" and key not in devices and _is_setting(value)]
        options = {key: zero[key] for key in set_keys if key in STAGES}
        return cls(
            zero_stage=zero_stage_of(config),
            offload_optimizer=None if devices["offload_optimizer"] == "none" else devices["offload_optimizer"],
            offload_param=None if devices["offload_param"] == "none" else devices["offload_param"],
            nvme_path=None if not paths or not all(paths) else paths[0],
            precision=precision_of(config),
            other_zero_options=tuple(key for key in set_keys if key not in STAGES),
            **options,
        )

    @classmethod
    def from_accelerate(cls, block: dict, mixed_precision) -> "DeepSpeedSpec":
        """What the rules read of an Accelerate config's deepspeed_config block and its top-level mixed_precision."""
        stage = block.get("zero_stage")
        devices = {
            option: device if device in OFFLOAD_DEVICES and device != "none" else None
            for option in ("offload_optimizer", "offload_param")
            for device in [block.get(f"{option}_device")]
        }
        paths = [block.get(f"{option}_nvme_path") for option, device in devices.items() if device == "nvme"]
        return cls(
            zero_stage=stage if stage in STAGE_NUMBERS and not isinstance(stage, bool) else 2,  # Accelerate's default
            offload_optimizer=devices["offload_optimizer"],
            offload_param=devices["offload_param"],
            nvme_path=None if not paths or not all(paths) else paths[0],
            precision={"fp16": "fp16", "bf16": "bf16"}.get(mixed_precision, "fp32"),
        )

    def to_dict(self) -> dict:
        """The DeepSpeed file for this spec (call check_spec first)."""
        return build_deepspeed_config(self)

    def given(self) -> set[str]:
        """The zero_optimization options set (the rules about a stage read only these)."""
        return {option for option in STAGES if getattr(self, option) is not None} | set(self.other_zero_options)


def _is_setting(value) -> bool:
    return value is not None and value != AUTO


def violations(spec: DeepSpeedSpec) -> list[Violation]:
    """The rules a DeepSpeed setting breaks however it is written: fp16 that DeepSpeed does not loss-scale, options the
    ZeRO stage ignores silently, offloading to nvme without a path."""
    found = []
    if unscaled_fp16(spec.zero_stage, spec.precision):
        found.append(
            Violation(
                "precision",
                f"{{precision}} at {{zero_stage}} 0: {UNSCALED_FP16}",
                "set {zero_stage} to 1 (on one GPU the same memory), or use {bf16} instead.",
            )
        )
    for option in unused_at_stage(sorted(spec.given()), spec.zero_stage):
        found.append(
            Violation(
                option,
                f"{{{option}}} means nothing at {{zero_stage}} {spec.zero_stage}: DeepSpeed uses it at "
                f"{stages_text(option)} only and ignores it silently otherwise.",
                f"set {{zero_stage}} to {stage_for(option)}, or remove {{{option}}}.",
            )
        )
    for option in ("offload_optimizer", "offload_param"):
        if needs_nvme_path(getattr(spec, option), spec.nvme_path) and applies(option, spec.zero_stage):
            found.append(
                Violation(
                    f"{option}_nvme_path",
                    f"{{{option}}} nvme needs {{{option}_nvme_path}}.",
                    f"add {{{option}_nvme_path}} /local/nvme (a fast local disk on every node).",
                )
            )
    return found


class FlagWords(dict):
    """{zero_stage} -> --zero_stage; {precision} -> --fp16 (the one precision a rule names)."""

    def __missing__(self, name: str) -> str:
        special = {"precision": "--fp16", "bf16": "--bf16"}
        return special.get(name, "--nvme_path" if name.endswith("nvme_path") else f"--{name}")


class KeyWords(dict):
    """{zero_stage} -> zero_optimization.stage, as a DeepSpeed file spells it."""

    def __missing__(self, name: str) -> str:
        special = {"zero_stage": "zero_optimization.stage", "precision": "fp16.enabled", "bf16": "bf16"}
        if name.endswith("_nvme_path"):
            return f"zero_optimization.{name.removesuffix('_nvme_path')}.nvme_path"
        return special.get(name, f"zero_optimization.{name}")


class AccelerateWords(dict):
    """{zero_stage} -> deepspeed_config.zero_stage, as an Accelerate config spells it."""

    def __missing__(self, name: str) -> str:
        special = {
            "precision": "mixed_precision fp16",
            "bf16": "mixed_precision bf16",
            "offload_optimizer": "deepspeed_config.offload_optimizer_device",
            "offload_param": "deepspeed_config.offload_param_device",
        }
        return special.get(name, f"deepspeed_config.{name}")


def worded(violation: Violation, words: dict) -> tuple[str, str, str]:
    """(where, what is wrong, the fix) of a violation in `words` (FlagWords, KeyWords or AccelerateWords)."""
    where = words[violation.option].split(" ")[0]
    return where, violation.message.format_map(words), violation.fix.format_map(words)


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
    "stage3_gather_16bit_weights_on_model_save": (3,),
}


def warmup_too_long(warmup, total) -> bool:
    """Whether a schedule warms up for the whole run or longer: the decay never comes (WarmupDecayLR), or
    DeepSpeed divides by total - warmup = 0 (WarmupCosineLR). Values that are not step counts: no opinion."""
    steps = [v for v in (warmup, total) if isinstance(v, int) and not isinstance(v, bool)]
    return len(steps) == 2 and warmup >= total


def stages_using(option: str) -> tuple[int, ...]:
    """The ZeRO stages at which a zero_optimization option means something (any stage3_* key: stage 3)."""
    return STAGES.get(option, (3,) if option.startswith("stage3_") else STAGE_NUMBERS)


def applies(option: str, stage: int) -> bool:
    """Whether `option` means something at ZeRO `stage`."""
    return stage in stages_using(option)


def unused_at_stage(options: Iterable[str], stage: int) -> list[str]:
    """The options, of those set, that DeepSpeed ignores silently at ZeRO `stage`."""
    return [option for option in options if not applies(option, stage)]


def stages_text(option: str) -> str:
    stages = stages_using(option)
    return "stage 3" if stages == (3,) else "stages " + ", ".join(map(str, stages))


def stage_for(option: str) -> int:
    """The stage to suggest for an option set at a stage that ignores it."""
    stages = stages_using(option)
    return 2 if stages == (1, 2) else stages[-1]


def needs_nvme_path(device: str | None, nvme_path: str | None) -> bool:
    return device == "nvme" and not nvme_path


UNSCALED_FP16 = (
    "at ZeRO stage 0 DeepSpeed 0.19 does not loss-scale fp16: engine.backward (the HF Trainer's and Accelerate's "
    "too) leaves the loss unscaled and the optimizer divides the gradients by the scale, so the run does not learn "
    "(deepspeedai/DeepSpeed#8393)."
)


def unscaled_fp16(stage: int, precision: str | None) -> bool:
    """Whether DeepSpeed would train at ZeRO `stage` in `precision` without scaling the loss (UNSCALED_FP16)."""
    return stage == 0 and precision == "fp16"


def check_spec(spec: DeepSpeedSpec) -> list[str]:
    """Reject combinations DeepSpeed would ignore silently; return warnings for ones it bends."""
    for violation in violations(spec):
        _, message, fix = worded(violation, FlagWords())
        raise DistsetupError(message, fix)
    if spec.optimizer.betas and not all(0 <= b < 1 for b in spec.optimizer.betas):
        raise DistsetupError(
            f"--betas {spec.optimizer.betas[0]} {spec.optimizer.betas[1]}: each beta must be in [0, 1).",
            "use e.g. --betas 0.9 0.95.",
        )
    if (
        spec.optimizer.name == "none"
        and spec.scheduler.name in ("WarmupLR", "WarmupDecayLR")
        and spec.optimizer.lr is None
        and not spec.hf_auto
    ):
        raise DistsetupError(
            f"--scheduler {spec.scheduler.name} with --optimizer none needs --lr: the schedule's "
            "warmup_max_lr replaces the training script's learning rate.",
            "add --lr with the peak learning rate of your optimizer.",
        )
    if spec.nvme_path and "nvme" not in (spec.offload_optimizer, spec.offload_param):
        raise DistsetupError(
            "--nvme_path is only used with --offload_optimizer nvme or --offload_param nvme.",
            "drop --nvme_path, or offload to nvme.",
        )
    needs_total = spec.scheduler.name in ("WarmupDecayLR", "WarmupCosineLR")
    if needs_total and spec.scheduler.total_num_steps is None and not spec.hf_auto:
        raise DistsetupError(
            f"--scheduler {spec.scheduler.name} needs --total_num_steps.",
            "add --total_num_steps N (the number of optimizer steps of the run).",
        )
    warmup = spec.scheduler.warmup_num_steps
    if needs_total and warmup_too_long(
        DEFAULT_WARMUP_STEPS if warmup is None else warmup, spec.scheduler.total_num_steps
    ):
        given = (
            f"--warmup_num_steps {warmup}"
            if warmup is not None
            else f"the default --warmup_num_steps {DEFAULT_WARMUP_STEPS}"
        )
        raise DistsetupError(
            f"{given} is not shorter than --total_num_steps {spec.scheduler.total_num_steps}: the "
            "warmup would take the whole run.",
            "warm up for a small part of the run (e.g. a tenth), or raise --total_num_steps.",
        )
    warnings = []
    if spec.offload_optimizer == "nvme" and spec.zero_stage in (1, 2):
        warnings.append(
            f"at ZeRO stage {spec.zero_stage} DeepSpeed keeps optimizer states in CPU memory; "
            "it swaps them to NVMe only at stage 3."
        )
    return warnings


# The file's precision sections; DeepSpeed still reads the old spelling "bfloat16" for "bf16".
PRECISION_SECTIONS = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def enabled_precisions(config: dict) -> set[str]:
    """The 16-bit precisions a DeepSpeed file enables (more than one is a problem)."""
    return {p for key, p in PRECISION_SECTIONS.items() if _section(config, key).get("enabled") is True}


def precision_of(config: dict) -> str:
    """The training precision a DeepSpeed file asks for: bf16, fp16 or fp32."""
    enabled = enabled_precisions(config)
    return "bf16" if "bf16" in enabled else "fp16" if "fp16" in enabled else "fp32"


def zero_stage_of(config: dict) -> int:
    stage = _section(config, "zero_optimization").get("stage", 0)
    return stage if stage in STAGE_NUMBERS else 0


def offload_device(config: dict, block: str) -> str:
    """Where zero_optimization.offload_optimizer / offload_param puts its states: none, cpu or nvme."""
    device = _section(_section(config, "zero_optimization"), block).get("device")
    return device if device in OFFLOAD_DEVICES else "none"


def batch_of(config: dict, world_size: int) -> BatchSizes:
    """The batch sizes DeepSpeed derives from the file at `world_size` (BatchMismatch where none fit)."""
    micro, accumulation, train = (
        _positive_int(config, key) for key in (FILE_KEYS.micro, FILE_KEYS.accumulation, FILE_KEYS.train)
    )
    return complete_batch(micro, accumulation, train, world_size, FILE_KEYS)


def auto_paths(data, path=()) -> list[tuple]:
    """Paths of every "auto" value in a nested dict/list."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in auto_paths(v, path + (k,))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in auto_paths(v, path + (i,))]
    return [path] if data == AUTO else []


def without_auto(data):
    """A copy with "auto" values removed: the HF Trainer fills them, so the schema need not see them."""
    if isinstance(data, dict):
        return {k: without_auto(v) for k, v in data.items() if v != AUTO}
    if isinstance(data, list):
        return [without_auto(v) for v in data]
    return data


NO_BATCH = "neither train_batch_size nor train_micro_batch_size_per_gpu is set"


def deepspeed_notes(config: dict) -> list[str]:
    """What a file for distsetup's trainer leaves to the run config, that another reader would need."""
    if set(BATCH_KEYS) & set(config):
        return []
    return [
        f"{NO_BATCH}: distsetup's trainer takes the batch from the run config (training.micro_batch_size, "
        "gradient_accumulation_steps); deepspeed.initialize of this file alone refuses to start (add "
        "train_micro_batch_size_per_gpu, or --micro_batch_size to `distsetup deepspeed`)."
    ]


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")


def deepspeed_problems(
    config: dict, world_size: int | None = None, hf: bool = False, batch_elsewhere: bool = True
) -> list[Problem]:
    """Schema problems, then the rules DeepSpeed itself checks late, silently ignores or bends. `batch_elsewhere`:
    a reader fills in a batch the file leaves out (distsetup's trainer from the run config); the HF Trainer and
    Accelerate fill only "auto"."""
    problems = []
    if not hf:
        problems += [
            Problem(
                join_path(p),
                '"auto" is only filled in by the Hugging Face Trainer; DeepSpeed '
                "itself (and distsetup's trainer) cannot use it.",
                "write a value (`distsetup deepspeed` without "
                "--hf_auto writes numbers); a file for TrainingArguments(deepspeed=...) passes "
                "`distsetup validate --hf`.",
            )
            for p in auto_paths(config)
        ]
    if not set(BATCH_KEYS) & set(config) and not batch_elsewhere:
        problems.append(
            Problem(
                "train_micro_batch_size_per_gpu",
                f"{NO_BATCH}; DeepSpeed refuses to start.",
                "set train_micro_batch_size_per_gpu (and gradient_accumulation_steps).",
            )
        )
    config = without_auto(config)
    problems += schema_problems(config, "deepspeed")
    if len(enabled_precisions(config)) > 1:
        problems.append(
            Problem(
                "bf16.enabled", "fp16 and bf16 are both enabled.", "enable one of them (bf16 on Ampere or newer GPUs)."
            )
        )
    problems += [Problem(*worded(v, KeyWords())) for v in violations(DeepSpeedSpec.from_dict(config))]
    schedule = _section(_section(config, "scheduler"), "params")
    if warmup_too_long(schedule.get("warmup_num_steps"), schedule.get("total_num_steps")):
        problems.append(
            Problem(
                "scheduler.params.warmup_num_steps",
                f"{schedule['warmup_num_steps']} warmup steps are not fewer than total_num_steps "
                f"{schedule['total_num_steps']}: the warmup would take the whole run.",
                "warm up for a small part of the run (e.g. a tenth), or raise total_num_steps.",
            )
        )
    problems += _batch_problems(config, world_size)
    return problems


def _batch_problems(config: dict, world_size: int | None) -> list[Problem]:
    """The batch identity at `world_size`, where a train batch size is given (else DeepSpeed computes it)."""
    if world_size is None or _positive_int(config, "train_batch_size") is None:
        return []
    try:
        batch_of(config, world_size)
    except BatchMismatch as e:
        return [
            Problem(
                "train_batch_size",
                f"{e.message}.",
                f"set train_batch_size to {e.fits} (and the other two to match), or drop it and let DeepSpeed "
                "compute it.",
            )
        ]
    return []


def _section(config: dict, key: str) -> dict:
    """config[key] when it is a dict, else {} (a wrong type is already a schema problem)."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _positive_int(config: dict, key: str) -> int | None:
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
    reduce_bucket = _pick(spec.reduce_bucket_size, auto)
    if reduce_bucket is not None:
        zero["reduce_bucket_size"] = reduce_bucket
    if spec.zero_stage == 3:
        for key, value in (
            ("stage3_prefetch_bucket_size", _pick(spec.stage3_prefetch_bucket_size, auto)),
            ("stage3_param_persistence_threshold", _pick(spec.stage3_param_persistence_threshold, auto)),
            ("stage3_max_live_parameters", spec.stage3_max_live_parameters),
            # on unless refused: without it the HF Trainer and save_16bit_model save no weights at stage 3
            ("stage3_gather_16bit_weights_on_model_save", spec.stage3_gather_16bit_weights_on_model_save is not False),
        ):
            if value is not None:
                zero[key] = value
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

"""The rules of a DeepSpeed setting, however it is written: `violations` (fp16 that is not loss-scaled, options
the ZeRO stage ignores, nvme without a path), said in flags, in a file's keys or in Accelerate's keys; the command's
checks of its flags (`check_spec`); and what only a file can get wrong (`deepspeed_problems`: the batch identity,
"auto", the schema)."""

import dataclasses
from collections.abc import Iterable

from distsetup.errors import DistsetupError
from distsetup.formats.batch import BatchMismatch
from distsetup.formats.deepspeed import (
    AUTO,
    DEFAULT_WARMUP_STEPS,
    STAGE_NUMBERS,
    STAGES,
    DeepSpeedSpec,
    batch_of,
    enabled_precisions,
    positive_int_at,
    section_of,
    stage_as_read,
)
from distsetup.formats.deepspeed_params import params_problems
from distsetup.formats.deepspeed_refusals import refused_at_start
from distsetup.formats.problems import Problem, Violation, closest, join_path, schema_problems


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
        if needs_nvme_path(getattr(spec, option), spec.nvme_path_of(option)) and applies(option, spec.zero_stage):
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
    """The stage to suggest for an option set at a stage that ignores it: 2 where it takes it (ZeRO-Offload is
    stage 2 with the optimizer on the CPU), else the highest that does."""
    stages = stages_using(option)
    return 2 if 2 in stages else stages[-1]


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
    bent = nvme_bent_at_stage(spec.zero_stage, spec.offload_optimizer)
    return [bent] if bent else []


def nvme_bent_at_stage(stage: int | None, offload_optimizer: str | None) -> str | None:
    """What DeepSpeed makes of the optimizer offloaded to nvme below stage 3, where it bends it, else None."""
    if offload_optimizer == "nvme" and stage in (1, 2):
        return (
            f"at ZeRO stage {stage} DeepSpeed keeps optimizer states in CPU memory; it swaps them to NVMe only at "
            "stage 3."
        )
    return None


# Where "auto" is a value of DeepSpeed's own (its default), not one the HF Trainer fills
DEEPSPEEDS_OWN_AUTO = {("data_types", "keep_in_fp32_modules")}


def auto_paths(data, path=()) -> list[tuple]:
    """Paths of every "auto" value the HF Trainer fills in a nested dict/list."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in auto_paths(v, path + (k,))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in auto_paths(v, path + (i,))]
    return [path] if data == AUTO and path not in DEEPSPEEDS_OWN_AUTO else []


# Every "auto" the HF Trainer fills: transformers' HfTrainerDeepSpeedConfig from TrainingArguments and the model's
# hidden size, then Accelerate's DeepSpeedPlugin, which it runs through, from its own settings (the stage from its
# default, the rest from accelerate launch's flags or config); the plugin refuses any other ("... not found in
# kwargs").
FILLED_BY_THE_HF_TRAINER = {
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
    "fp16.enabled",
    "bf16.enabled",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_param.nvme_path",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


def unfilled_auto(config: dict) -> list[Problem]:
    """The "auto" values no reader fills, not even the HF Trainer (a key it fills, misspelt, among them)."""
    problems = []
    for path in auto_paths(config):
        where = join_path(path)
        if where in FILLED_BY_THE_HF_TRAINER:
            continue
        section, _, key = where.rpartition(".")
        close = closest(
            key,
            [filled.rpartition(".")[2] for filled in FILLED_BY_THE_HF_TRAINER if filled.rpartition(".")[0] == section],
        )
        problems.append(
            Problem(
                where,
                '"auto" here is filled by no reader: the HF Trainer fills only the batch, accumulation, clipping, '
                "precision, optimizer and scheduler values and three bucket sizes, Accelerate, which it runs "
                "through, the stage (and under accelerate launch the offload and 16-bit save settings), and it "
                'stops on any other ("not found in kwargs").',
                f"did you mean '{close}'?" if close else "write a value.",
            )
        )
    return problems


def without_auto(data):
    """A copy with "auto" values removed: the HF Trainer fills them, so the schema need not see them."""
    if isinstance(data, dict):
        return {k: without_auto(v) for k, v in data.items() if v != AUTO}
    if isinstance(data, list):
        return [without_auto(v) for v in data]
    return data


NO_BATCH = "neither train_batch_size nor train_micro_batch_size_per_gpu is set"


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
    if hf:
        problems += unfilled_auto(config)
    if hf and "zero_optimization" not in config:
        problems.append(
            Problem(
                "zero_optimization",
                'is missing: Accelerate, and the HF Trainer through it, refuses such a file ("Please specify the '
                'ZeRO optimization config").',
                'add "zero_optimization": {"stage": 0} (or the stage you mean).',
            )
        )
    original, config = config, without_auto(config)
    problems += schema_problems(config, "deepspeed") + refused_at_start(config) + params_problems(original)
    if len(enabled_precisions(config)) > 1:
        problems.append(
            Problem(
                "bf16.enabled", "fp16 and bf16 are both enabled.", "enable one of them (bf16 on Ampere or newer GPUs)."
            )
        )
    stage = stage_as_read(original)
    if stage is not None:  # else the stage is a problem, and no rule of a stage applies
        spec = dataclasses.replace(DeepSpeedSpec.from_dict(config), zero_stage=stage)
        problems += [Problem(*worded(v, KeyWords())) for v in violations(spec)]
    schedule = section_of(section_of(config, "scheduler"), "params")
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
    if world_size is None or positive_int_at(config, "train_batch_size") is None:
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

"""What the Hugging Face Trainer does with a DeepSpeed file: it fills each "auto" from TrainingArguments (and the
model's hidden size, the world size, the number of steps), and stops when a value that is not "auto" differs
from the TrainingArguments one. The formulas are transformers' `HfTrainerDeepSpeedConfig`
(`trainer_config_process`, `trainer_config_finalize`), written once here for `validate` and `--resolve`."""

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from distsetup.formats.batch import global_batch_of
from distsetup.formats.deepspeed import model_sized, zero_stage_of
from distsetup.formats.problems import Problem, wrong_type


def is_training_arguments(data: dict) -> bool:
    """TrainingArguments as `to_dict()`/`to_json_string()` save them, or as a user writes them for the parser."""
    named = {"deepspeed", "fsdp", "fsdp_config"}  # the settings of a file they name
    return "per_device_train_batch_size" in data or ("output_dir" in data and bool(named & set(data)))


@dataclass(frozen=True)
class TrainerValues:
    """The TrainingArguments the Trainer reads for a DeepSpeed file, at transformers' defaults."""

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    fp16: bool = False
    bf16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    warmup_steps: float = 0  # a ratio of the steps when below 1
    max_steps: int = -1
    auto_find_batch_size: bool = False  # the Trainer then fills the batch sizes without comparing them

    @classmethod
    def from_dict(cls, data: dict) -> "TrainerValues":
        """The values a TrainingArguments file holds (of the right types: see type_problems), defaults for the rest."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @staticmethod
    def type_problems(data: dict) -> list[Problem]:
        return [
            problem
            for f in fields(TrainerValues)
            if f.name in data and (problem := _wrong(f, data[f.name])) is not None
        ]


def _wrong(f, value) -> Problem | None:
    return wrong_type(f.name, value, f.type, "TrainingArguments")


@dataclass(frozen=True)
class Context:
    """What the Trainer knows beyond TrainingArguments when it fills a file in."""

    world_size: int | None = None
    hidden_size: int | None = None

    def steps(self, t: TrainerValues) -> int | None:
        return t.max_steps if t.max_steps > 0 else None


@dataclass(frozen=True)
class Fill:
    """One "auto" the Trainer fills: the DeepSpeed key, its value (None where unknown here), from what."""

    path: str
    value: Callable[[TrainerValues, Context], Any]
    source: str
    must_match: bool = True  # a value that is not "auto" must equal it (fill_match), else only filled
    zero3_only: bool = False
    batch_size: bool = False  # only filled under auto_find_batch_size (transformers' trainer_config_process)


def _train_batch(t: TrainerValues, c: Context):
    if not c.world_size:
        return None
    return global_batch_of(t.per_device_train_batch_size, t.gradient_accumulation_steps, c.world_size)


def _warmup(t: TrainerValues, c: Context):
    steps = c.steps(t)
    if t.warmup_steps >= 1:
        return max(1, int(t.warmup_steps))
    return None if steps is None else max(1, math.ceil(steps * t.warmup_steps))


def _hidden(key: str):
    return lambda t, c: None if c.hidden_size is None else model_sized(key, c.hidden_size)


FILLS = (
    Fill(
        "train_micro_batch_size_per_gpu",
        lambda t, c: t.per_device_train_batch_size,
        "per_device_train_batch_size",
        batch_size=True,
    ),
    Fill("gradient_accumulation_steps", lambda t, c: t.gradient_accumulation_steps, "gradient_accumulation_steps"),
    Fill(
        "train_batch_size",
        _train_batch,
        "world size x per_device_train_batch_size x gradient_accumulation_steps",
        batch_size=True,
    ),
    Fill("gradient_clipping", lambda t, c: t.max_grad_norm, "max_grad_norm"),
    Fill("optimizer.params.lr", lambda t, c: t.learning_rate, "learning_rate"),
    Fill("optimizer.params.betas", lambda t, c: [t.adam_beta1, t.adam_beta2], "adam_beta1+adam_beta2"),
    Fill("optimizer.params.eps", lambda t, c: t.adam_epsilon, "adam_epsilon"),
    Fill("optimizer.params.weight_decay", lambda t, c: t.weight_decay, "weight_decay"),
    Fill("scheduler.params.warmup_min_lr", lambda t, c: 0, "always 0", must_match=False),
    Fill("scheduler.params.warmup_max_lr", lambda t, c: t.learning_rate, "learning_rate"),
    Fill("fp16.enabled", lambda t, c: t.fp16 or t.fp16_full_eval, "fp16|fp16_full_eval"),
    Fill("bf16.enabled", lambda t, c: t.bf16 or t.bf16_full_eval, "bf16|bf16_full_eval"),
    Fill(
        "zero_optimization.reduce_bucket_size",
        _hidden("reduce_bucket_size"),
        "hidden_size x hidden_size",
        must_match=False,
    ),
    Fill(
        "zero_optimization.stage3_prefetch_bucket_size",
        _hidden("stage3_prefetch_bucket_size"),
        "0.9 x hidden_size x hidden_size",
        must_match=False,
        zero3_only=True,
    ),
    Fill(
        "zero_optimization.stage3_param_persistence_threshold",
        _hidden("stage3_param_persistence_threshold"),
        "10 x hidden_size",
        must_match=False,
        zero3_only=True,
    ),
    Fill("scheduler.params.total_num_steps", lambda t, c: c.steps(t), "the training steps (max_steps)"),
    Fill("scheduler.params.warmup_num_steps", _warmup, "warmup_steps (at least 1)"),
)
MISSING_HINTS = {
    "train_batch_size": "give --world_size",
    "zero_optimization.reduce_bucket_size": "give --hidden_size",
    "zero_optimization.stage3_prefetch_bucket_size": "give --hidden_size",
    "zero_optimization.stage3_param_persistence_threshold": "give --hidden_size",
    "scheduler.params.total_num_steps": "give --max_steps",
    "scheduler.params.warmup_num_steps": "give --max_steps",
}


def _node(config: dict, path: str) -> tuple[dict | None, str]:
    *parents, key = path.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), key


@dataclass(frozen=True)
class Resolved:
    path: str
    value: Any  # None: not known from what was given
    source: str


def resolve_auto(config: dict, trainer: TrainerValues, context: Context) -> list[Resolved]:
    """Each "auto" in a DeepSpeed file and what the Trainer puts there."""
    resolved = []
    for fill in FILLS:
        node, key = _node(config, fill.path)
        if node is None or node.get(key) != "auto":
            continue
        if fill.zero3_only and zero_stage_of(config) != 3:
            resolved.append(Resolved(fill.path, None, 'stays "auto": the Trainer fills it at ZeRO stage 3 only'))
            continue
        value = fill.value(trainer, context)
        resolved.append(Resolved(fill.path, value, fill.source if value is not None else MISSING_HINTS[fill.path]))
    return resolved


def filled_in(config: dict, trainer: TrainerValues, context: Context) -> dict:
    """The DeepSpeed file as the Trainer hands it to DeepSpeed: each "auto" it fills replaced by its value."""
    filled = copy.deepcopy(config)
    for r in resolve_auto(config, trainer, context):
        node, key = _node(filled, r.path)
        if node is not None and r.value is not None:
            node[key] = r.value
    return filled


def mismatch_problems(config: dict, trainer: TrainerValues, context: Context, where: str) -> list[Problem]:
    """Values of the DeepSpeed file (`where`) the Trainer compares with TrainingArguments and stops on."""
    problems = []
    if trainer.auto_find_batch_size and zero_stage_of(config) == 3:
        problems.append(
            Problem(
                "zero_optimization.stage",
                "3, with TrainingArguments' auto_find_batch_size: the HF Trainer refuses them together "
                '("isn\'t supported yet with DeepSpeed Zero-3").',
                "use ZeRO-1 or 2, or drop auto_find_batch_size.",
            )
        )
    for fill in FILLS:
        node, key = _node(config, fill.path)
        if node is None or not fill.must_match or node.get(key) in (None, "auto"):
            continue
        if fill.batch_size and trainer.auto_find_batch_size:
            continue
        ours, theirs = node[key], fill.value(trainer, context)
        if theirs is None or ours == theirs:
            continue
        ours_json, theirs_json = json.dumps(ours), json.dumps(theirs)  # as the files spell them: true, not True
        if isinstance(ours, str) != isinstance(theirs, str):
            message = (
                f"{ours_json} in {where} is {_a(ours)}, TrainingArguments' {fill.source} is {theirs_json}, "
                f"{_a(theirs)}: the HF Trainer compares them as they are and stops with a mismatch."
            )
            fix = f'write {theirs_json} without quotes (or "auto").'
        else:
            message = (
                f"{ours_json} in {where} differs from TrainingArguments' {fill.source} ({theirs_json}): the HF Trainer "
                'stops ("Please correct the following DeepSpeed config values that mismatch TrainingArguments").'
            )
            fix = 'make them equal, or write "auto" and let the Trainer fill it in.'
        problems.append(Problem(fill.path, message, fix))
    return problems


def _a(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    return f"a {type(value).__name__}"

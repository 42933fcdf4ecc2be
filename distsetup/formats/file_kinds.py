"""Which kind of config a file holds, read from its keys whatever its name or the flag it came with. A file given
where another kind goes is one line saying what it is and where it goes: a DeepSpeed file given as --config was read
as a run config ("bf16 is training.precision here", which invited editing the DeepSpeed file), a run config given as
--deepspeed_config got "unknown key 'data'" and DeepSpeed's sixty keys."""

import functools

from distsetup.formats.accelerate import is_accelerate_config
from distsetup.formats.fsdp import UNPREFIXED
from distsetup.formats.hf_trainer import is_training_arguments
from distsetup.formats.problems import Problem, load_schema
from distsetup.formats.runconfig import SECTIONS

# An FSDP file's keys as the HF Trainer's fsdp_config spells them, without fsdp_ (but activation_checkpointing,
# which a DeepSpeed file has too)
HF_TRAINER_FSDP_KEYS = set(UNPREFIXED) - {"activation_checkpointing"}
# Keys only a DeepSpeed file has at its top
DEEPSPEED_MARKS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu")
KIND_WORDS = {
    "run_config": "a run config",
    "deepspeed": "a DeepSpeed config",
    "fsdp": "an FSDP config",
    "accelerate": "an Accelerate config",
    "training_args": "the HF Trainer's TrainingArguments",
}
WHERE_IT_GOES = {
    "run_config": "--config",
    "deepspeed": "--deepspeed_config (or distributed.deepspeed_config in the run config)",
    "fsdp": "--fsdp_config (or distributed.fsdp_config in the run config)",
    "accelerate": "accelerate launch's --config_file",
    "training_args": "the HF Trainer's arguments",
}


def content_kind(data: dict) -> str | None:
    """The kind of config `data` is by its keys; None where they do not say. A run config's sections say it first:
    one with a key of Accelerate's or TrainingArguments' beside them is a run config with an unknown key."""
    if any(isinstance(key, str) and key in SECTIONS for key in data):
        return "run_config"
    if is_accelerate_config(data):
        return "accelerate"
    if is_training_arguments(data):
        return "training_args"
    if any(isinstance(k, str) and (k.startswith("fsdp_") or k in HF_TRAINER_FSDP_KEYS) for k in data):
        return "fsdp"
    if any(k in data for k in DEEPSPEED_MARKS):
        return "deepspeed"
    return None


def wrong_kind_problem(data: dict, expected: str) -> Problem | None:
    """The problem of a config of another kind than `expected`, said of the whole file; None where its keys do not
    say it is another, or where it has keys of its own kind too (a run config with a stray train_batch_size is a
    run config with an unknown key, said by its own rules)."""
    found = content_kind(data)
    if found is None or found == expected:
        return None
    if found not in ("accelerate", "training_args") and any(_of_kind(key, expected) for key in data):
        return None
    telling = [key for key in data if content_kind({key: data[key]}) == found] or list(data)  # the keys that say so
    keys = ", ".join(str(key) for key in telling[:3])
    return Problem(
        "",
        f"this is {KIND_WORDS[found]} ({keys}), not {KIND_WORDS[expected]}.",
        f"give it as {WHERE_IT_GOES[found]}, and give {KIND_WORDS[expected]} here.",
    )


def _of_kind(key, kind: str) -> bool:
    """Whether top-level `key` is one only a config of `kind` has (a run config's section, a DeepSpeed file's marks,
    an FSDP file's own keys): keys several kinds share (bf16, gradient_accumulation_steps) tell nothing."""
    if kind == "run_config":
        return key in SECTIONS
    if kind == "deepspeed":
        return key in DEEPSPEED_MARKS
    if kind == "fsdp":
        return key in _fsdp_keys()
    return False


@functools.cache
def _fsdp_keys() -> frozenset[str]:
    return frozenset(load_schema("fsdp")["properties"])

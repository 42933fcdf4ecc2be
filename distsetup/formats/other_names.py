"""Other tools' names for run-config settings: the HF Trainer's (TrainingArguments), Accelerate's, DeepSpeed's and
the guides users copy from. Each known name is either read as distsetup's own key (OTHER_NAMES, with a note saying
so) or, where distsetup has no such key, answered with where the setting lives here (ELSEWHERE). One table:
`read_other_names` applies it to a run config, `hint` words the suggestion for an unknown key (another tool's name,
or a typo of one: `lerning_rate` is answered with what `learning_rate` is read as), and
tests/unit/test_other_names.py holds the HF Trainer's names to TrainingArguments' own fields."""

import difflib
from collections.abc import Callable, Collection
from dataclasses import dataclass

from distsetup.formats.problems import Problem, closest

HF = "the HF Trainer's"
GUIDES = "the guides'"


def _same(value):
    return value


def _precision(name: str) -> Callable:
    """bf16: true -> bf16; false says nothing about the precision (None: read as not set)."""
    return lambda value: name if value is True else None if value is False else value


def _checkpointing(value):
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


def _whole(value):
    """num_train_epochs is a float in TrainingArguments: 3.0 is 3 here (3.5 stays, and the schema refuses it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


@dataclass(frozen=True)
class OtherName:
    """A name another tool gives a setting, read as distsetup's `ours` ("training.lr") through `meaning`."""

    ours: str
    origin: str  # whose name it is: "the HF Trainer's"
    meaning: Callable = _same


def _reporters(value):
    """The HF Trainer's report_to as one string: "none" is none, a name is a list of it ("all" is refused: no list
    here means TensorBoard where installed, not every integration)."""
    return [] if value == "none" else [value] if isinstance(value, str) and value != "all" else value


# distsetup's own keys in forms users write (an older distsetup's boolean, the HF Trainer's string): key -> its form
OWN_KEY_FORMS: dict[tuple[str, str], Callable] = {
    ("training", "activation_checkpointing"): _checkpointing,  # a boolean before it had modes
    ("training", "chunked_loss"): lambda value: (  # `yes`/`no`: YAML 1.1's booleans (PyYAML), 1.2's strings (--fix)
        {True: "always", False: "never", "yes": "always", "on": "always", "no": "never", "off": "never"}.get(
            value if isinstance(value, bool) else value.lower(), value
        )
        if isinstance(value, bool | str)
        else value  # a list, a number: the schema's to refuse
    ),
    ("training", "report_to"): _reporters,
}

# (section the name is written in, the name) -> what it is read as
OTHER_NAMES: dict[tuple[str, str], OtherName] = {
    ("training", "learning_rate"): OtherName("training.lr", HF),
    ("training", "per_device_train_batch_size"): OtherName("training.micro_batch_size", HF),
    ("training", "batch_size"): OtherName("training.micro_batch_size", GUIDES),  # per GPU, as the guides say
    ("training", "num_train_epochs"): OtherName("training.epochs", HF, _whole),
    ("training", "max_grad_norm"): OtherName("training.grad_clip", HF),
    ("training", "gradient_clip_norm"): OtherName("training.grad_clip", GUIDES),
    ("training", "bf16"): OtherName("training.precision", HF, _precision("bf16")),
    ("training", "fp16"): OtherName("training.precision", HF, _precision("fp16")),
    ("training", "gradient_checkpointing"): OtherName("training.activation_checkpointing", HF, _checkpointing),
    ("training", "logging_steps"): OtherName("training.log_interval", HF),
    ("training", "save_steps"): OtherName("training.checkpoint_interval", HF),
    ("training", "eval_steps"): OtherName("training.eval_interval", HF),
    ("training", "save_total_limit"): OtherName("training.keep_checkpoints", HF),
    ("training", "torch_compile"): OtherName("training.compile", HF),
    ("distributed", "gradient_accumulation_steps"): OtherName("training.gradient_accumulation_steps", GUIDES),
    ("training", "ddp_find_unused_parameters"): OtherName("distributed.find_unused_parameters", HF),
    ("distributed", "ddp_find_unused_parameters"): OtherName("distributed.find_unused_parameters", HF),
}

# Names that mean one thing to one tool and another to the next: refused with both meanings.
AMBIGUOUS = {
    ("training", "train_batch_size"): (
        "train_batch_size means samples per GPU in the Accelerate guide and the global batch (micro x accumulation "
        "x world size) in DeepSpeed.",
        "write training.micro_batch_size (per GPU), or set micro_batch_size and gradient_accumulation_steps so that "
        "their product x the world size is the global batch.",
    ),
}

HF4 = "the HF Trainer's (transformers 4)"
ACCELERATE = "Accelerate's"
DEEPSPEED = "DeepSpeed's"
SCHEDULE = (
    "is not a choice here: distsetup's trainer runs the HF Trainer's cosine, warming up linearly over "
    "training.warmup_steps and decaying to training.min_lr_ratio x lr (0 for HF's); a DeepSpeed file's scheduler "
    "block replaces it"
)
# Other tools' names with no key of that name here: (whose name, where the setting lives or why there is none).
ELSEWHERE = {
    "lr_scheduler_type": (HF, SCHEDULE),
    "lr_scheduler_kwargs": (HF, SCHEDULE),
    "warmup_ratio": (HF4, "is training.warmup_steps here, in steps (warmup_ratio x max_steps)"),
    "adam_beta1": (HF, "is training.betas[0] here (betas: [beta1, beta2])"),
    "adam_beta2": (HF, "is training.betas[1] here (betas: [beta1, beta2])"),
    "adam_epsilon": (
        HF,
        "has no equivalent: AdamW runs with PyTorch's eps 1e-8 (a DeepSpeed file's optimizer may set eps)",
    ),
    "optim": (HF, "has no equivalent: distsetup's trainer runs AdamW (a DeepSpeed file's optimizer block replaces it)"),
    "dataloader_num_workers": (HF, "is data.num_workers here"),
    "per_device_eval_batch_size": (HF, "has no equivalent: evaluation runs micro-batches of training.micro_batch_size"),
    "deepspeed": (HF, "is distributed.deepspeed_config here (with distributed.backend: deepspeed)"),
    "fsdp": (HF, "is distributed.backend: fsdp here (settings in distributed.fsdp_config, or inline as fsdp_* keys)"),
    "logging_dir": (
        GUIDES,
        "has no equivalent: metrics go to training.output_dir (metrics.jsonl and TensorBoard's files)",
    ),
    "use_cpu": (HF, "has no equivalent: the trainer runs on the GPUs it is given, else on the CPU"),
    "mixed_precision": (ACCELERATE, "is training.precision here (fp32, bf16 or fp16)"),
    "num_workers": (GUIDES, "is data.num_workers here"),
    "zero_stage": (
        ACCELERATE,
        "is zero_optimization.stage of the DeepSpeed file (`distsetup deepspeed --zero_stage N`) that "
        "distributed.deepspeed_config names",
    ),
    # an Accelerate config's: the world is the launch script's (distsetup launcher and slurm), not the run config's
    "distributed_type": (ACCELERATE, "is distributed.backend here (ddp, fsdp, deepspeed or single)"),
    "dynamo_backend": (ACCELERATE, "is training.compile here (true: torch.compile with inductor)"),
    "num_processes": (ACCELERATE, "is the launch script's: --num_gpus_per_node (x --num_nodes) of distsetup launcher"),
    "num_machines": (ACCELERATE, "is the launch script's: --num_nodes of distsetup launcher or slurm"),
    "machine_rank": (ACCELERATE, "is the launch script's: --node_rank of distsetup launcher (or NODE_RANK)"),
    "main_process_ip": (ACCELERATE, "is the launch script's: --master_addr of distsetup launcher (or MASTER_ADDR)"),
    "main_process_port": (ACCELERATE, "is the launch script's: --master_port of distsetup launcher or slurm"),
    "gpu_ids": (ACCELERATE, "is the launch script's: --gpus of distsetup launcher"),
    "compute_environment": (
        ACCELERATE,
        "is an Accelerate config's (accelerate launch's --config_file), not a run config's",
    ),
    "train_micro_batch_size_per_gpu": (DEEPSPEED, "is training.micro_batch_size here"),
    "gradient_clipping": (DEEPSPEED, "is training.grad_clip here"),
    "max_seq_length": (GUIDES, "is model.block_size here"),
    "seq_len": (GUIDES, "is model.block_size here"),
    "model_name_or_path": (GUIDES, "is model.hf_path here (a local folder: nothing is downloaded)"),
}


def hint(section: str, key: str, known: Collection[str] = ()) -> str | None:
    """The suggestion for an unknown run-config key in `section` (whose own keys are `known`): where another tool's
    name is read or lives here; for a typo, the closest of the section's own keys and the other tools' names, said
    with what that name is read as; in the model section, where no key of its own is close, model.args; None where
    nothing is close."""
    said = _said(section, key)
    if said is not None:
        return said
    meant = {name: f"did you mean '{name}'? {_said(section, name)}" for name in OTHER_TOOLS_NAMES}
    meant |= {
        k: f"did you mean '{k}' (read as {_here(o.ours, section)})?"
        for (s, k), o in OTHER_NAMES.items()
        if s == section
    }
    meant |= {name: f"did you mean '{name}'?" for name in known}
    typo_of = closest(key, meant)
    if section == "model" and not _close_to_the_sections_own(key, typo_of, known):  # the model's own (num_experts)
        return (
            f"the model's own settings go under model.args (its builder's arguments: model.args.{key}), or in the "
            "config.json of model.hf_path."
        )
    return None if typo_of is None else meant[typo_of]


def _close_to_the_sections_own(key: str, typo_of: str | None, known: Collection[str]) -> bool:
    """Whether the model section's unknown `key` is a typo of `typo_of`: one of its own names, or another tool's
    name it nearly spells (max_seq_lenght), not one it merely resembles (num_experts: data's num_workers)."""
    if typo_of is None:
        return False
    own = set(known) | {k for s, k in OTHER_NAMES if s == "model"}
    return typo_of in own or difflib.SequenceMatcher(None, key, typo_of).ratio() >= 0.85


def _said(section: str, key: str) -> str | None:
    """What is said of another tool's name written in `section`: what it is read as, or where it lives here."""
    known = OTHER_NAMES.get((section, key)) or next((o for (_, k), o in OTHER_NAMES.items() if k == key), None)
    if known is not None:  # a known name in another section
        return f"{key} is {known.ours} here."
    if key in ELSEWHERE:
        return f"{key} {ELSEWHERE[key][1]}."
    return None


def _here(ours: str, section: str) -> str:
    """distsetup's key as said in `section`: lr in training, training.gradient_accumulation_steps elsewhere."""
    target_section, key = ours.split(".")
    return key if target_section == section else ours


OTHER_TOOLS_NAMES = frozenset({key for _, key in OTHER_NAMES} | set(ELSEWHERE))


def sets_something(section: str, key: str, value) -> bool:
    """Whether `value` under `section.key` sets its setting (another tool's `fp16: false` sets nothing)."""
    other = OTHER_NAMES.get((section, key))
    return other is None or other.meaning(value) is not None


def spellings(section: str, key: str) -> set[str]:
    """Every name the setting `section.key` is written under ("training.learning_rate": "training.lr" and the other
    tools' names read as it), itself included."""
    other = OTHER_NAMES.get((section, key))
    ours = other.ours if other else f"{section}.{key}"
    return {ours, f"{section}.{key}"} | {f"{s}.{k}" for (s, k), name in OTHER_NAMES.items() if name.ours == ours}


def read_other_names(raw: dict) -> tuple[list[str], list[Problem], dict[str, str]]:
    """Rewrite other tools' names in `raw` into distsetup's keys (in place). Returns a note per name read, the
    problems (an ambiguous name; one setting written twice with different values), and each key read from another
    name: {"training.lr": "training.learning_rate"}."""
    notes, problems = [], []
    for (section, key), (message, fix) in AMBIGUOUS.items():
        values = raw.get(section)
        if isinstance(values, dict) and key in values:
            problems.append(Problem(f"{section}.{key}", message, fix))
    written: dict[str, str] = {}  # distsetup's key -> the name it was read from
    for (section, key), other in OTHER_NAMES.items():
        values = raw.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        value = other.meaning(values.pop(key))
        target_section, target_key = other.ours.split(".")
        target = raw.setdefault(target_section, {})
        if not isinstance(target, dict):
            continue  # the schema says what is wrong with the section
        if value is None:
            notes.append(f"{section}.{key}: false ({other.origin} name) sets nothing; {other.ours} decides.")
            continue
        if target_key in target and target[target_key] != value:
            first = written.get(other.ours, other.ours)
            problems.append(
                Problem(
                    f"{section}.{key}",
                    f"{section}.{key} {value!r} and {first} {target[target_key]!r} set one setting ({other.ours}) "
                    "to different values.",
                    f"keep one of them ({other.ours} is distsetup's own name).",
                )
            )
            continue
        target[target_key] = value
        written[other.ours] = f"{section}.{key}"
        notes.append(f"{section}.{key} ({other.origin} name) is read as {other.ours}: {value!r}.")
    return notes, problems, written

"""The rules of FSDP settings (`violations`: options that mean nothing together or that a client refuses), said in
flags for `distsetup fsdp` (`check_fsdp_spec`) and in the file's keys for `validate` (`fsdp_findings`), with what
Accelerate and the HF Trainer would read differently."""

from distsetup.errors import DistsetupError
from distsetup.formats.fsdp import (
    KEYS,
    MIXED_PRECISION,
    TRAINER_CPU_OFFLOAD,
    TRANSFORMER,
    UNPREFIXED,
    WRAP_POLICIES,
    FsdpSpec,
    as_accelerate_reads,
)
from distsetup.formats.problems import Problem, Violation, schema_problems

# FSDP1-only knobs: FSDP2 (fully_shard) has no such argument.
FSDP1_ONLY = {
    "backward_prefetch": "prefetches one module ahead by itself",
    "forward_prefetch": "prefetches one module ahead by itself",
    "use_orig_params": "always keeps the original parameters",
    "sync_module_states": "loads states with torch.distributed.checkpoint instead",
    "buffer_dtype": "leaves buffers in their own dtype",
}


class FlagWords(dict):
    """{option} -> --option; {BFLOAT16} -> the flag's value."""

    def __missing__(self, name: str) -> str:
        return name if name.isupper() else f"--{name}"


class KeyWords(dict):
    """{option} -> the file's key; {BFLOAT16} -> the file's value."""

    def __missing__(self, name: str) -> str:
        return MIXED_PRECISION.get(name, name) if name.isupper() else KEYS[name]


def violations(spec: FsdpSpec, given: set[str]) -> list[Violation]:
    """Options that mean nothing together or that a client refuses. `given`: the options the user set (a rule
    about a default applies only where it was chosen)."""
    found = []
    if spec.fsdp_version == 2:
        # a file that states version 2 means FSDP2 and is refused; one that states none is read as FSDP2 and told
        stated = "fsdp_version" in given
        found += [
            Violation(
                name,
                f"{{{name}}} means nothing with {{fsdp_version}} 2: FSDP2 {why}."
                if stated
                else f"{{{name}}} is not used: distsetup's trainer runs FSDP2, which {why}.",
                f"remove {{{name}}}, or use {{fsdp_version}} 1." if stated else f"remove {{{name}}}.",
                said=not stated,
            )
            for name, why in FSDP1_ONLY.items()
            if name in given
        ]
        if spec.state_dict_type == "LOCAL_STATE_DICT":
            found.append(
                Violation("state_dict_type", "LOCAL_STATE_DICT does not exist in FSDP2.", "use SHARDED_STATE_DICT.")
            )
    policy = spec.auto_wrap_policy if "auto_wrap_policy" in given else None
    # (TRANSFORMER_BASED_WRAP without classes wraps the model's own blocks: model_blocks_note says so)
    if policy == "SIZE_BASED_WRAP" and "min_num_params" not in given:
        found.append(
            Violation(
                "min_num_params",
                "{auto_wrap_policy} SIZE_BASED_WRAP needs {min_num_params}.",
                "add {min_num_params} 100000000 (wrap modules of at least that many parameters).",
            )
        )
    for option, needed_by in (("transformer_layer_cls_to_wrap", TRANSFORMER), ("min_num_params", "SIZE_BASED_WRAP")):
        if policy is not None and policy != needed_by and option in given:
            found.append(
                Violation(
                    option,
                    f"{{{option}}} is only used with {needed_by}, not {policy}.",
                    f"remove it, or use {{auto_wrap_policy}} {needed_by}.",
                    said=True,
                )
            )
    found += [
        Violation(
            "transformer_layer_cls_to_wrap",
            f"{{transformer_layer_cls_to_wrap}} '{name}' is not a class name: each name between its commas is looked "
            "up as a class of the model's.",
            "write the classes' names, e.g. LlamaDecoderLayer (several: A,B).",
        )
        for name in spec.transformer_layer_cls_to_wrap
        if not name.isidentifier()
    ]
    if spec.mixed_precision == "no":
        found += [
            Violation(
                name,
                f"{{{name}}} means nothing without {{mixed_precision}}.",
                "set {mixed_precision} to {BFLOAT16} or {FLOAT16}, or remove it.",
            )
            for name in ("reduce_dtype", "buffer_dtype")
            if name in given
        ]
    if spec.fsdp_version == 1 and spec.cpu_ram_efficient_loading and spec.sync_module_states is False:
        found.append(
            Violation(
                "sync_module_states",
                "{cpu_ram_efficient_loading} with {fsdp_version} 1 needs {sync_module_states}: other ranks start "
                "from empty weights.",
                "set {sync_module_states} to true.",
            )
        )
    return found


def model_blocks_note(spec: FsdpSpec, given: set[str]) -> str | None:
    """Where TRANSFORMER_BASED_WRAP names no classes: whose blocks each reader wraps (Accelerate's plugin, which the
    HF Trainer uses too, falls back to the model's _no_split_modules), in {words}."""
    if "auto_wrap_policy" not in given or spec.auto_wrap_policy != TRANSFORMER or spec.transformer_layer_cls_to_wrap:
        return None
    return (
        "{auto_wrap_policy} TRANSFORMER_BASED_WRAP without {transformer_layer_cls_to_wrap} wraps the model's own "
        "blocks: a Hugging Face model's _no_split_modules (Accelerate, the HF Trainer and distsetup's trainer), your "
        "own model's model.layer_classes or its largest list of one class (distsetup's trainer only: Accelerate then "
        "wraps none but the whole model); name them with {transformer_layer_cls_to_wrap} (e.g. LlamaDecoderLayer)."
    )


def check_fsdp_spec(spec: FsdpSpec) -> list[str]:
    """Refuse the first rule the flags break, naming the flag and the fix; return warnings."""
    for violation in violations(spec, spec.given()):
        words = FlagWords()
        raise DistsetupError(violation.message.format_map(words), violation.fix.format_map(words))
    warnings = []
    if note := model_blocks_note(spec, spec.given()):
        warnings.append(note.format_map(FlagWords()))
    if spec.fsdp_version == 2 and spec.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        warnings.append(
            f"{spec.sharding_strategy} with FSDP2: distsetup's trainer builds the device mesh it needs, but "
            "Accelerate's FSDP2 reads only fsdp_reshard_after_forward"
            + (
                " (false = SHARD_GRAD_OP); use DDP there for no sharding."
                if spec.sharding_strategy == "NO_SHARD"
                else " and needs its own 2-D mesh (parallelism_config) for hybrid sharding, which `distsetup launcher "
                "--launch_method accelerate` passes (the nodes replicate, each node's processes shard)."
            )
        )
    if spec.mixed_precision != "no":
        warnings.append(
            "the file's mixed_precision and fsdp_reduce_dtype are read by distsetup's trainer only: give Accelerate "
            f"`accelerate launch --mixed_precision {MIXED_PRECISION[spec.mixed_precision]}` (distsetup launcher "
            f"passes it), the HF Trainer TrainingArguments({MIXED_PRECISION[spec.mixed_precision]}=True)."
        )
    return warnings


def fsdp_problems(config: dict) -> list[Problem]:
    """Schema problems, then every rule the file breaks (the rules `distsetup fsdp` refuses), in its keys."""
    return fsdp_findings(config)[0]


def accelerate_yaml_fsdp_problems(config: dict, mixed_precision) -> list[Problem]:
    """fsdp_problems of an Accelerate config YAML's fsdp_config, which `accelerate launch` alone reads, and what it
    reads there otherwise than the HF Trainer and distsetup's trainer read an FSDP file: each key as fsdp_ and the
    key (accelerate/commands/launch.py), so the Trainer's cpu_offload and a precision here are ignored, and a policy
    left unset wraps nothing. `mixed_precision`: the config's own, which `accelerate launch` trains in."""
    written = {key if str(key).startswith("fsdp") else f"fsdp_{key}": key for key in config}  # as read -> as written
    read = {key: config[original] for key, original in written.items()}
    problems = []
    if read.get(TRAINER_CPU_OFFLOAD) is True and read.get("fsdp_offload_params") is not True:
        problems.append(
            Problem(
                written[TRAINER_CPU_OFFLOAD],
                "is true, and accelerate launch reads only fsdp_offload_params (fsdp_cpu_offload is the HF Trainer's): "
                "nothing is offloaded.",
                "write fsdp_offload_params: true.",
            )
        )
    given = read.get("fsdp_mixed_precision")
    if given in MIXED_PRECISION.values() and given != (mixed_precision or "no"):
        problems.append(
            Problem(
                written["fsdp_mixed_precision"],
                f"is {given!r}, and accelerate launch takes the precision from the config's own mixed_precision "
                f"({mixed_precision or 'no'}), not from here: it trains in that.",
                f"set mixed_precision: {given} at the top of the config, and remove it here.",
            )
        )
    if "fsdp_transformer_layer_cls_to_wrap" in read and "fsdp_auto_wrap_policy" not in read:
        problems.append(
            Problem(
                "fsdp_auto_wrap_policy",
                "is not set beside fsdp_transformer_layer_cls_to_wrap: accelerate launch then wraps nothing (the "
                "model is one FSDP unit, gathered whole), where the HF Trainer would wrap the classes.",
                f"add fsdp_auto_wrap_policy: {TRANSFORMER}.",
            )
        )
    return problems + fsdp_findings(config, accelerate_yaml=True)[0]


def fsdp_findings(
    config: dict, inline: bool = False, accelerate_yaml: bool = False, hf_trainer: bool = False
) -> tuple[list[Problem], list[str]]:
    """The problems of FSDP settings in the file's keys (schema, readers, rules), and the notes: what the rules say
    about settings no reader uses. `inline`: written in a run config, where FSDP2 goes without saying and the
    blocks to wrap are model.layer_classes; `accelerate_yaml`: an Accelerate config's fsdp_config; `hf_trainer`: a
    file for the HF Trainer's fsdp_config."""
    # inline, FSDP2 and its full sharding go without saying (a file states both, as Accelerate writes them)
    implied = {"fsdp_version": 2, "fsdp_sharding_strategy": FsdpSpec.sharding_strategy}
    if hf_trainer:
        config = _without_hf_trainer_defaults(config)
    spelling_problems = [] if inline else _spelling_problems(config, accelerate_yaml, hf_trainer)
    config, spellings = (config, []) if inline else as_accelerate_reads(config)
    if hf_trainer and "fsdp_version" not in config:
        config = {"fsdp_version": 2, **config}  # the HF Trainer's default
    problems = schema_problems({**implied, **config} if inline else config, "fsdp")
    if not inline and "fsdp_version" not in config:
        problems.append(
            Problem(
                "fsdp_version",
                "is not set: the HF Trainer reads such a file as FSDP2 (its default) and accelerate launch as FSDP1 "
                "(its own), so what it means depends on who reads it.",
                'add "fsdp_version": 2 (or 1); a file for the HF Trainer alone passes `distsetup validate --hf`.',
            )
        )
    wrong = {p.path.split(".")[0].split("[")[0] for p in problems}  # the rules read only well-typed keys
    readable = {key: value for key, value in config.items() if key not in wrong}
    words = KeyWords()
    given = {name for name, key in KEYS.items() if key in readable}
    broken = [v for v in violations(FsdpSpec.from_dict(readable), given) if KEYS[v.option] not in wrong]
    problems += (
        spelling_problems
        + _reader_problems(readable, hf_trainer)
        + [Problem(KEYS[v.option], v.message.format_map(words), v.fix.format_map(words)) for v in broken if not v.said]
    )
    notes = spellings + [v.message.format_map(words) for v in broken if v.said]
    if hf_trainer:
        notes += _hf_trainer_notes(readable)
    if not inline and (note := model_blocks_note(FsdpSpec.from_dict(readable), given)):
        notes.append(note.format_map(words))
    return problems, notes


# What TrainingArguments writes into its fsdp_config whatever it was given (TrainingArguments.to_json_string() holds
# them): XLA's switches off, and min_num_params 0, which it reads as none given
HF_TRAINER_DEFAULTS = {"xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False, "min_num_params": 0}


def _without_hf_trainer_defaults(config: dict) -> dict:
    """The settings without the values the HF Trainer writes for what it was not given (HF_TRAINER_DEFAULTS), with or
    without their fsdp_ prefix, as it reads both."""
    return {key: value for key, value in config.items() if not _is_hf_trainer_default(key, value)}


def _is_hf_trainer_default(key: str, value) -> bool:
    default = HF_TRAINER_DEFAULTS.get(str(key).removeprefix("fsdp_"), object())
    return type(value) is type(default) and value == default  # False is no 0, as JSON tells them apart


def _hf_trainer_notes(config: dict) -> list[str]:
    """What the HF Trainer's fsdp_config reads of a file otherwise than Accelerate, where TrainingArguments' `fsdp`
    words (offload, shard_grad_op), which a file does not show, may still say it: notes, not problems."""
    notes = []
    if config.get("fsdp_offload_params") is True and TRAINER_CPU_OFFLOAD not in config:
        notes.append(
            "fsdp_offload_params: true, and the HF Trainer reads only fsdp_cpu_offload (cpu_offload): it offloads "
            'only where TrainingArguments\' fsdp says offload; write "fsdp_cpu_offload": true beside it.'
        )
    strategy = config.get("fsdp_sharding_strategy")
    fsdp1_strategy_alone = config.get("fsdp_version") == 1 and "fsdp_reshard_after_forward" not in config
    if fsdp1_strategy_alone and strategy not in (None, "FULL_SHARD"):
        notes.append(
            f"fsdp_sharding_strategy: {strategy!r} without fsdp_reshard_after_forward: the HF Trainer's FSDP1 reads "
            "the strategy from fsdp_reshard_after_forward or TrainingArguments' fsdp words, FULL_SHARD where neither "
            f'says it; write "fsdp_reshard_after_forward": "{strategy}" beside it.'
        )
    return notes


def _spelling_problems(config: dict, accelerate_yaml: bool, hf_trainer: bool) -> list[Problem]:
    """Spellings Accelerate's plugin reads, that a reader of the file stops on or misreads: the HF Trainer takes a
    wrapping policy by its upper-case name only, `accelerate launch` a config YAML's classes to wrap as one string
    (a list becomes "['A', 'B']")."""
    problems = []
    for key, value in config.items():
        full = UNPREFIXED.get(key, key)
        if hf_trainer and full == "fsdp_auto_wrap_policy" and isinstance(value, str):
            if value != value.upper() and value.upper() in WRAP_POLICIES:
                problems.append(
                    Problem(
                        key,
                        f"{value!r}: the HF Trainer takes only the upper-case name.",
                        f'write "{value.upper()}".',
                    )
                )
        if accelerate_yaml and full == "fsdp_transformer_layer_cls_to_wrap" and isinstance(value, list):
            problems.append(
                Problem(
                    key,
                    "is a list: `accelerate launch` passes it on as one string, \"['A', 'B']\", whose names no "
                    "class has.",
                    f"write {','.join(map(str, value))!r}, the names between commas.",
                )
            )
    return problems


def _reader_problems(config: dict, hf_trainer: bool = False) -> list[Problem]:
    """Keys that Accelerate, the HF Trainer and distsetup's trainer would read differently (`hf_trainer`: a file for
    the HF Trainer)."""
    problems = []
    offloads = {config[key] for key in ("fsdp_offload_params", TRAINER_CPU_OFFLOAD) if key in config}
    if len(offloads) > 1:
        problems.append(
            Problem(
                TRAINER_CPU_OFFLOAD,
                f"is {config[TRAINER_CPU_OFFLOAD]} but fsdp_offload_params is {config['fsdp_offload_params']}: the "
                "HF Trainer reads the first, Accelerate the second.",
                "give both the same value.",
            )
        )
    reshard, version = config.get("fsdp_reshard_after_forward"), config.get("fsdp_version", 2)
    if version == 2 and isinstance(reshard, str):
        problems.append(
            Problem(
                "fsdp_reshard_after_forward",
                f"{reshard!r} is a sharding strategy; FSDP2 reads true or false here.",
                "write true (FULL_SHARD) or false (SHARD_GRAD_OP).",
            )
        )
    strategy = config.get("fsdp_sharding_strategy")
    # for the HF Trainer (else reader_notes says who reads which; the launcher passes accelerate both); NO_SHARD and
    # the hybrid ones have a note of their own: no reshard setting makes Accelerate's FSDP2 do them
    if version == 2 and reshard is None and strategy == "SHARD_GRAD_OP" and hf_trainer:
        problems.append(
            Problem(
                "fsdp_sharding_strategy",
                f"is {strategy!r} without fsdp_reshard_after_forward: the HF Trainer's FSDP2 reads "
                "fsdp_reshard_after_forward alone, true unless given (FULL_SHARD).",
                'write "fsdp_reshard_after_forward": false beside it.',
            )
        )
    if version == 1 and reshard is not None and strategy is not None and reshard != strategy:  # None: required
        problems.append(
            Problem(
                "fsdp_reshard_after_forward",
                f"is {reshard!r} but fsdp_sharding_strategy is {strategy!r}: the HF Trainer's FSDP1 reads the "
                "sharding strategy from fsdp_reshard_after_forward, Accelerate from fsdp_sharding_strategy.",
                f'write "fsdp_reshard_after_forward": "{strategy}".',
            )
        )
    return problems

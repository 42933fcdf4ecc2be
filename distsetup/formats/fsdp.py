"""The FSDP file (Accelerate's `fsdp_config` key names) as one typed model, FsdpSpec: built from the flags of
`distsetup fsdp`, read from a file (`FsdpSpec.from_dict`: the trainer, `doctor`), written (`build_fsdp_config`)
and checked by one set of rules (`violations`), said in flags for the command and in keys for `validate`."""

import dataclasses
import json
from dataclasses import dataclass

from distsetup.errors import DistsetupError
from distsetup.formats.problems import Problem, Violation, schema_problems

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# Strategies that free parameters after forward (and gather them again for backward).
RESHARDS_AFTER_FORWARD = {
    "FULL_SHARD": True,
    "HYBRID_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}
# The training precision, the --mixed_precision value and Accelerate's mixed_precision value of each.
# distsetup's trainer has no loss scaling under FSDP (Accelerate and the HF Trainer do, with ShardedGradScaler).
TRAINER_PRECISIONS = ("fp32", "bf16")
TRAINER_FP16_PROBLEM = (
    "FSDP with fp16 needs loss scaling, which distsetup's trainer does not do for FSDP.",
    "use bf16 (or fp32) with FSDP, or fp16 with DDP or DeepSpeed.",
)
_PRECISION_NAMES = (("fp32", "no", "no"), ("fp16", "FLOAT16", "fp16"), ("bf16", "BFLOAT16", "bf16"))
MIXED_PRECISION = {flag: value for _, flag, value in _PRECISION_NAMES}  # --mixed_precision -> the file's value
FLAG_FOR_PRECISION = {precision: flag for precision, flag, _ in _PRECISION_NAMES}
PRECISION_OF_FILE = {value: precision for precision, _, value in _PRECISION_NAMES}
TRANSFORMER = "TRANSFORMER_BASED_WRAP"
WRAP_POLICIES = (TRANSFORMER, "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
DTYPES = ("float32", "bfloat16", "float16")
# FSDP1-only knobs: FSDP2 (fully_shard) has no such argument.
FSDP1_ONLY = {
    "backward_prefetch": "prefetches one module ahead by itself",
    "forward_prefetch": "prefetches one module ahead by itself",
    "use_orig_params": "always keeps the original parameters",
    "sync_module_states": "loads states with torch.distributed.checkpoint instead",
    "buffer_dtype": "leaves buffers in their own dtype",
}


@dataclass(frozen=True)
class FsdpSpec:
    """Everything `distsetup fsdp` was asked for."""

    fsdp_version: int = 2
    sharding_strategy: str = "FULL_SHARD"
    mixed_precision: str = "no"  # no | FLOAT16 | BFLOAT16
    reduce_dtype: str | None = None
    buffer_dtype: str | None = None
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    min_num_params: int | None = None
    state_dict_type: str = "SHARDED_STATE_DICT"
    backward_prefetch: str | None = None
    forward_prefetch: bool | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool | None = None
    use_orig_params: bool | None = None
    reshard_after_forward: bool | None = None  # None: as the sharding strategy does

    @classmethod
    def from_dict(cls, config: dict) -> "FsdpSpec":
        """The spec a file states; what it leaves out takes the defaults above (call fsdp_problems first).
        A file without fsdp_version is read as FSDP2, the version distsetup writes and its trainer runs."""
        values = {name: config[key] for name, key in KEYS.items() if key in config}
        if TRAINER_CPU_OFFLOAD in config:
            values.setdefault("cpu_offload", config[TRAINER_CPU_OFFLOAD])
        if isinstance(values.get("reshard_after_forward"), str):  # FSDP1's strategy, the HF Trainer's way
            values.setdefault("sharding_strategy", values["reshard_after_forward"])
            values["reshard_after_forward"] = None
        if "mixed_precision" in values:
            values["mixed_precision"] = FLAG_FOR_PRECISION[PRECISION_OF_FILE[values["mixed_precision"]]]
        if "transformer_layer_cls_to_wrap" in values:
            values["transformer_layer_cls_to_wrap"] = tuple(
                name.strip() for name in values["transformer_layer_cls_to_wrap"].split(",") if name.strip()
            )
        return cls(**values)

    @property
    def precision(self) -> str:
        """The training precision: fp32, bf16 or fp16."""
        return PRECISION_OF_FILE[MIXED_PRECISION[self.mixed_precision]]

    @property
    def reshards_after_forward(self) -> bool:
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return RESHARDS_AFTER_FORWARD.get(self.sharding_strategy, True)

    def given(self) -> set[str]:
        """The options set to something (for the flags: every option given or defaulted to a value)."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, ())}


# The HF Trainer's key for what Accelerate calls fsdp_offload_params: the file holds both.
TRAINER_CPU_OFFLOAD = "fsdp_cpu_offload"
# Spec field -> the file's key (Accelerate's name).
KEYS = {
    "fsdp_version": "fsdp_version",
    "sharding_strategy": "fsdp_sharding_strategy",
    "mixed_precision": "mixed_precision",
    "reduce_dtype": "fsdp_reduce_dtype",
    "buffer_dtype": "fsdp_buffer_dtype",
    "auto_wrap_policy": "fsdp_auto_wrap_policy",
    "transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "min_num_params": "fsdp_min_num_params",
    "state_dict_type": "fsdp_state_dict_type",
    "backward_prefetch": "fsdp_backward_prefetch",
    "forward_prefetch": "fsdp_forward_prefetch",
    "cpu_offload": "fsdp_offload_params",
    "activation_checkpointing": "fsdp_activation_checkpointing",
    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "sync_module_states": "fsdp_sync_module_states",
    "use_orig_params": "fsdp_use_orig_params",
    "reshard_after_forward": "fsdp_reshard_after_forward",
}


class FlagWords(dict):
    """{option} -> --option; {BFLOAT16} -> the flag's value."""

    def __missing__(self, name: str) -> str:
        return name if name.isupper() else f"--{name}"


class KeyWords(dict):
    """{option} -> the file's key; {BFLOAT16} -> the file's value."""

    def __missing__(self, name: str) -> str:
        return MIXED_PRECISION.get(name, name) if name.isupper() else KEYS[name]


def violations(spec: FsdpSpec, given: set[str], layer_classes_known: bool = False) -> list[Violation]:
    """Options that mean nothing together or that a client refuses. `given`: the options the user set (a rule
    about a default applies only where it was chosen); `layer_classes_known`: the run config names the blocks to
    wrap (model.layer_classes, else the model's own), as it does for the settings written inline."""
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
    for option, needed_by, example in (
        ("transformer_layer_cls_to_wrap", "TRANSFORMER_BASED_WRAP", "LlamaDecoderLayer (Block for the built-in model)"),
        ("min_num_params", "SIZE_BASED_WRAP", "100000000 (wrap modules of at least that many parameters)"),
    ):
        if policy == needed_by and option not in given and not (layer_classes_known and needed_by == TRANSFORMER):
            found.append(
                Violation(
                    option, f"{{auto_wrap_policy}} {needed_by} needs {{{option}}}.", f"add {{{option}}} {example}."
                )
            )
        if policy is not None and policy != needed_by and option in given:
            found.append(
                Violation(
                    option,
                    f"{{{option}}} is only used with {needed_by}, not {policy}.",
                    f"remove it, or use {{auto_wrap_policy}} {needed_by}.",
                    said=True,
                )
            )
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


def check_fsdp_spec(spec: FsdpSpec) -> list[str]:
    """Refuse the first rule the flags break, naming the flag and the fix; return warnings."""
    for violation in violations(spec, spec.given()):
        words = FlagWords()
        raise DistsetupError(violation.message.format_map(words), violation.fix.format_map(words))
    warnings = []
    if spec.fsdp_version == 2 and spec.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        warnings.append(
            f"{spec.sharding_strategy} with FSDP2: distsetup's trainer builds the device mesh it needs, but "
            "Accelerate's FSDP2 reads only fsdp_reshard_after_forward"
            + (
                " (false = SHARD_GRAD_OP); use DDP there for no sharding."
                if spec.sharding_strategy == "NO_SHARD"
                else " and needs its own 2-D mesh (parallelism_config) for hybrid sharding."
            )
        )
    if spec.mixed_precision != "no":
        warnings.append(
            "the file's mixed_precision and fsdp_reduce_dtype are read by distsetup's trainer only: give Accelerate "
            f"`accelerate launch --mixed_precision {MIXED_PRECISION[spec.mixed_precision]}` (distsetup launcher "
            f"passes it), the HF Trainer TrainingArguments({MIXED_PRECISION[spec.mixed_precision]}=True)."
        )
    return warnings


def build_fsdp_config(spec: FsdpSpec) -> dict:
    """The FSDP config dict for `spec` (call check_fsdp_spec first)."""
    config: dict = {
        "fsdp_version": spec.fsdp_version,
        "fsdp_sharding_strategy": spec.sharding_strategy,
    }
    # FSDP2 reads a boolean here (Accelerate and the HF Trainer); the HF Trainer's FSDP1 reads the strategy here
    # and nowhere else (Accelerate's FSDP1 reads either).
    config["fsdp_reshard_after_forward"] = (
        spec.reshards_after_forward if spec.fsdp_version == 2 else spec.sharding_strategy
    )
    config["fsdp_auto_wrap_policy"] = spec.auto_wrap_policy
    if spec.transformer_layer_cls_to_wrap:
        config["fsdp_transformer_layer_cls_to_wrap"] = ",".join(spec.transformer_layer_cls_to_wrap)
    if spec.min_num_params is not None:
        config["fsdp_min_num_params"] = spec.min_num_params
    config["fsdp_state_dict_type"] = spec.state_dict_type
    config["fsdp_offload_params"] = spec.cpu_offload
    config[TRAINER_CPU_OFFLOAD] = spec.cpu_offload
    config["fsdp_activation_checkpointing"] = spec.activation_checkpointing
    config["fsdp_cpu_ram_efficient_loading"] = spec.cpu_ram_efficient_loading
    if spec.fsdp_version == 1:
        config["fsdp_backward_prefetch"] = spec.backward_prefetch or "BACKWARD_PRE"
        config["fsdp_forward_prefetch"] = bool(spec.forward_prefetch)
        config["fsdp_use_orig_params"] = spec.use_orig_params if spec.use_orig_params is not None else True
        config["fsdp_sync_module_states"] = (
            spec.sync_module_states if spec.sync_module_states is not None else spec.cpu_ram_efficient_loading
        )
    config["mixed_precision"] = MIXED_PRECISION[spec.mixed_precision]
    if spec.mixed_precision != "no":
        config["fsdp_reduce_dtype"] = spec.reduce_dtype or "float32"
        if spec.fsdp_version == 1:
            config["fsdp_buffer_dtype"] = spec.buffer_dtype or "float32"
    return config


def fsdp_problems(config: dict) -> list[Problem]:
    """Schema problems, then every rule the file breaks (the rules `distsetup fsdp` refuses), in its keys."""
    return fsdp_findings(config)[0]


def fsdp_findings(config: dict, inline: bool = False) -> tuple[list[Problem], list[str]]:
    """The problems of FSDP settings in the file's keys (schema, readers, rules), and the notes: what the rules say
    about settings no reader uses. `inline`: written in a run config, where FSDP2 goes without saying and the
    blocks to wrap are model.layer_classes."""
    # inline, FSDP2 and its full sharding go without saying (a file states both, as Accelerate writes them)
    implied = {"fsdp_version": 2, "fsdp_sharding_strategy": FsdpSpec.sharding_strategy}
    problems = schema_problems({**implied, **config} if inline else config, "fsdp")
    wrong = {p.path.split(".")[0].split("[")[0] for p in problems}  # the rules read only well-typed keys
    readable = {key: value for key, value in config.items() if key not in wrong}
    words = KeyWords()
    given = {name for name, key in KEYS.items() if key in readable}
    broken = [
        v
        for v in violations(FsdpSpec.from_dict(readable), given, layer_classes_known=inline)
        if KEYS[v.option] not in wrong
    ]
    problems += _reader_problems(readable) + [
        Problem(KEYS[v.option], v.message.format_map(words), v.fix.format_map(words)) for v in broken if not v.said
    ]
    notes = [v.message.format_map(words) for v in broken if v.said]
    return problems, notes


# The guides' spelling of FSDP settings written inline under `distributed:` (lowercase values, the precision as
# fsdp_mixed_precision + fsdp_param_dtype) -> the file's values. Every other fsdp_* key is the file's own.
INLINE_VALUES = {
    "fsdp_auto_wrap_policy": {
        "transformer_auto_wrap": TRANSFORMER,
        "transformer_based_wrap": TRANSFORMER,
        "size_based_wrap": "SIZE_BASED_WRAP",
        "size_based_auto_wrap": "SIZE_BASED_WRAP",
        "no_wrap": "NO_WRAP",
    },
    "fsdp_sharding_strategy": {s.lower(): s for s in SHARDING_STRATEGIES},
    "fsdp_state_dict_type": {s.lower(): s for s in STATE_DICT_TYPES},
    "fsdp_backward_prefetch": {s.lower(): s for s in BACKWARD_PREFETCH},
}
INLINE_PRECISION = ("fsdp_mixed_precision", "fsdp_param_dtype")
PARAM_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "no"}


def read_inline(distributed: dict) -> tuple[dict, list[str], list[Problem]]:
    """The FSDP settings written inline under `distributed:` (fsdp_* keys but fsdp_config), taken out of it and
    returned in the file's keys and values, with a note for each value read in another spelling and the problems
    of the precision keys. The file's rules (fsdp_findings) then judge the result."""
    inline = {k: distributed.pop(k) for k in list(distributed) if k.startswith("fsdp_") and k != "fsdp_config"}
    block, notes, problems = {}, [], []
    for key, value in inline.items():
        if key in INLINE_PRECISION:
            continue
        spelled = INLINE_VALUES.get(key, {}).get(value.lower()) if isinstance(value, str) else None
        if spelled is not None and spelled != value:
            notes.append(f"distributed.{key} {value!r} is read as {spelled} (the FSDP file's spelling).")
        block[key] = spelled or value
    mixed, dtype = (inline.get(k) for k in INLINE_PRECISION)
    if mixed is not None or dtype is not None:
        if dtype is not None and not (isinstance(dtype, str) and dtype.lower() in PARAM_DTYPES):
            problems.append(
                Problem("distributed.fsdp_param_dtype", f"{dtype!r} is not a dtype.", "write bfloat16 or float16.")
            )
        elif mixed is not None and not isinstance(mixed, bool):
            problems.append(
                Problem("distributed.fsdp_mixed_precision", f"{mixed!r} is not true or false.", "write true or false.")
            )
        elif mixed is True and dtype is None:
            problems.append(
                Problem(
                    "distributed.fsdp_mixed_precision",
                    "true, but no fsdp_param_dtype says which precision.",
                    "add fsdp_param_dtype: bfloat16 (or float16).",
                )
            )
        else:
            precision = "no" if mixed is False or dtype is None else PARAM_DTYPES[dtype.lower()]
            block["mixed_precision"] = precision
            said = " and ".join(f"distributed.{k} {json.dumps(inline[k])}" for k in INLINE_PRECISION if k in inline)
            notes.append(f"{said}: read as the FSDP file's mixed_precision {precision}.")
    return block, notes, problems


def inline_findings(block: dict) -> tuple[list[Problem], list[str]]:
    """fsdp_findings of settings written inline, said in the run config's keys."""
    problems, notes = fsdp_findings(block, inline=True)
    where = {"mixed_precision": "distributed.fsdp_mixed_precision"}
    return [Problem(where.get(p.path, f"distributed.{p.path}".rstrip(".")), p.message, p.fix) for p in problems], [
        f"distributed.{note}" for note in notes
    ]


def _reader_problems(config: dict) -> list[Problem]:
    """Keys that Accelerate and the HF Trainer would read differently."""
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
    if version == 1 and reshard is not None and reshard != strategy:
        problems.append(
            Problem(
                "fsdp_reshard_after_forward",
                f"is {reshard!r} but fsdp_sharding_strategy is {strategy!r}: the HF Trainer's FSDP1 reads the "
                "sharding strategy from fsdp_reshard_after_forward, Accelerate from fsdp_sharding_strategy.",
                f'write "fsdp_reshard_after_forward": "{strategy}".',
            )
        )
    return problems


# The keys not every reader reads alike (Accelerate's launcher, the HF Trainer's TrainingArguments, distsetup's
# trainer; tests/test_clients.py asks the first two); every other key all three read as written.
READERS = {
    "fsdp_offload_params": "Accelerate and distsetup's trainer; the HF Trainer reads fsdp_cpu_offload",
    TRAINER_CPU_OFFLOAD: "the HF Trainer and distsetup's trainer; Accelerate reads fsdp_offload_params",
    "fsdp_sharding_strategy": "Accelerate's FSDP1 and distsetup's trainer; FSDP2 and the HF Trainer read "
    "fsdp_reshard_after_forward",
    "mixed_precision": "distsetup's trainer only; Accelerate takes `accelerate launch --mixed_precision`, the HF "
    "Trainer TrainingArguments(bf16=/fp16=)",
    "fsdp_reduce_dtype": "distsetup's trainer only",
    "fsdp_buffer_dtype": "distsetup's trainer only (FSDP1: none of them)",
}


def reader_notes(config: dict) -> list[str]:
    """Who reads each key of the file that not every reader reads alike."""
    return [f"{key}: read by {who}." for key, who in READERS.items() if key in config]


# The file's keys that `accelerate launch` takes as flags of the same name.
ACCELERATE_FLAGS = {key for key in KEYS.values() if key.startswith("fsdp_")} - {
    "fsdp_reduce_dtype",
    "fsdp_buffer_dtype",
}


def accelerate_launch_args(config: dict) -> list[str]:
    """The FSDP file as `accelerate launch` flags: its launcher takes FSDP settings from flags (or its own config
    YAML), never from a JSON file, and the precision from --mixed_precision."""
    args = ["--use_fsdp", "--mixed_precision", str(config.get("mixed_precision", "no"))]
    for key, value in config.items():
        if key in ACCELERATE_FLAGS:
            args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args

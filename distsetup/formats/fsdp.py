"""The FSDP file (Accelerate's `fsdp_config` key names) as one typed model, FsdpSpec: built from the flags of
`distsetup fsdp`, read from a file (`FsdpSpec.from_dict`: the trainer, `doctor`) and written (`build_fsdp_config`);
with who reads which key, and the file as `accelerate launch` flags. Its rules are in fsdp_rules, the settings a run
config writes inline in fsdp_inline."""

import dataclasses
from dataclasses import dataclass

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
DTYPE_NAMES = ("float32", "bfloat16", "float16")


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
        """The spec a file states, in any spelling Accelerate reads (as_accelerate_reads); what it leaves out takes
        the defaults above (call fsdp_problems first). A file without fsdp_version is read as FSDP2, the version
        distsetup writes and its trainer runs; one without a sharding strategy as Accelerate reads it, FULL_SHARD
        (FSDP2: as fsdp_reshard_after_forward says)."""
        config = as_accelerate_reads(config)[0]
        values = {name: config[key] for name, key in KEYS.items() if key in config}
        if TRAINER_CPU_OFFLOAD in config:
            values.setdefault("cpu_offload", config[TRAINER_CPU_OFFLOAD])
        if isinstance(values.get("reshard_after_forward"), str):  # FSDP1's strategy, the HF Trainer's way
            values.setdefault("sharding_strategy", values["reshard_after_forward"])
            values["reshard_after_forward"] = None
        if "sharding_strategy" not in values and values.get("reshard_after_forward") is False:
            values["sharding_strategy"] = "SHARD_GRAD_OP"  # FSDP2's way of saying it
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

    @property
    def hybrid_fsdp2(self) -> bool:
        """FSDP2 sharding within a node and replicating across nodes, which Accelerate's FSDP2 does on its own 2-D
        mesh only (`accelerate launch --use_parallelism_config`)."""
        return self.fsdp_version == 2 and self.sharding_strategy.startswith("HYBRID")

    @property
    def wrapped_classes(self) -> tuple[str, ...]:
        """The classes each sharded as one unit, where the policy wraps by class (else none)."""
        return self.transformer_layer_cls_to_wrap if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" else ()

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


# The HF Trainer's fsdp_config takes each key without its fsdp_ prefix too (TrainingArguments strips it).
UNPREFIXED = {
    key.removeprefix("fsdp_"): key for key in (*KEYS.values(), TRAINER_CPU_OFFLOAD) if key.startswith("fsdp_")
}
# Names Accelerate's FullyShardedDataParallelPlugin upper-cases before reading them (accelerate/utils/dataclasses.py)
NAMED = {
    "fsdp_sharding_strategy": SHARDING_STRATEGIES,
    "fsdp_backward_prefetch": BACKWARD_PREFETCH,
    "fsdp_state_dict_type": (*STATE_DICT_TYPES, "LOCAL_STATE_DICT"),
    "fsdp_auto_wrap_policy": WRAP_POLICIES,
}


def as_accelerate_reads(config: dict) -> tuple[dict, list[str]]:
    """An FSDP file's settings in the spelling distsetup writes, read as Accelerate and the HF Trainer read them: a
    key without its fsdp_ prefix (the HF Trainer's fsdp_config), a name in any case, a sharding strategy by its
    number (1-5, FULL_SHARD first), the classes to wrap as a list; and a note for each read in another spelling."""
    read, notes, unprefixed = {}, [], []
    for key, value in config.items():
        full = UNPREFIXED.get(key, key)
        if full != key:
            unprefixed.append(key)
        spelled = value
        if isinstance(value, str) and value.upper() in NAMED.get(full, ()):
            spelled = value.upper()
        if full == "fsdp_sharding_strategy" and str(value).isdigit() and 1 <= int(value) <= len(SHARDING_STRATEGIES):
            spelled = SHARDING_STRATEGIES[int(value) - 1]
        if full == "fsdp_transformer_layer_cls_to_wrap" and isinstance(value, list):
            spelled = ",".join(map(str, value)) if all(isinstance(name, str) for name in value) else value
        if spelled != value:
            if full == "fsdp_auto_wrap_policy":
                readers = (
                    "by Accelerate and distsetup's trainer; the HF Trainer stops on it (it takes the upper-case name)"
                )
            else:
                readers = "as Accelerate and the HF Trainer read it"
            notes.append(f"{full}: {value!r} is read as {spelled!r}, {readers}.")
        read[full] = spelled
    if unprefixed:
        notes.insert(0, f"{', '.join(unprefixed)}: read as fsdp_* keys, as the HF Trainer reads its fsdp_config.")
    return read, notes


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


# The keys not every reader reads alike (Accelerate's launcher, the HF Trainer's TrainingArguments, distsetup's
# trainer; tests/unit/test_clients.py asks the first two); every other key all three read as written.
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
    YAML), never from a JSON file, and the precision from --mixed_precision. A file written for the HF Trainer is
    read as it reads it (keys without fsdp_, the classes to wrap as a list, its cpu_offload)."""
    read, _ = as_accelerate_reads(config)
    if TRAINER_CPU_OFFLOAD in read:
        read.setdefault("fsdp_offload_params", read[TRAINER_CPU_OFFLOAD])
    # the strategy, as distsetup's trainer reads it, in the key each FSDP version of Accelerate reads: FSDP1's
    # fsdp_sharding_strategy (an HF Trainer file says it in reshard_after_forward, which accelerate launch's default
    # strategy would outrank), FSDP2's fsdp_reshard_after_forward (true unless given)
    settings = FsdpSpec.from_dict(read)
    if settings.fsdp_version == 1:
        read.setdefault("fsdp_sharding_strategy", settings.sharding_strategy)
    else:
        read.setdefault("fsdp_reshard_after_forward", settings.reshards_after_forward)
    args = ["--use_fsdp", "--mixed_precision", str(read.get("mixed_precision", "no"))]
    for key, value in read.items():
        if key in ACCELERATE_FLAGS:
            args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args

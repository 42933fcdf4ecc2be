"""Building an FSDP config dict (Accelerate's `fsdp_config` key names) from a frozen spec."""

from dataclasses import dataclass

from distsetup.errors import DistsetupError

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# Strategies that free parameters after forward (and gather them again for backward).
RESHARDS_AFTER_FORWARD = {
    "FULL_SHARD": True,
    "HYBRID_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}
MIXED_PRECISION = {"no": "no", "FLOAT16": "fp16", "BFLOAT16": "bf16"}  # --mixed_precision -> Accelerate's value
FLAG_FOR_PRECISION = {"fp32": "no", "fp16": "FLOAT16", "bf16": "BFLOAT16"}  # training precision -> --mixed_precision
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
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


def check_fsdp_spec(spec: FsdpSpec) -> list[str]:
    """Reject options that mean nothing together, naming the flag and the fix; return warnings."""
    if spec.fsdp_version == 2:
        for name, why in FSDP1_ONLY.items():
            if getattr(spec, name) is not None:
                raise DistsetupError(
                    f"--{name} means nothing with --fsdp_version 2: FSDP2 {why}.",
                    f"drop --{name}, or use --fsdp_version 1.",
                )
    policy = spec.auto_wrap_policy
    if policy == "TRANSFORMER_BASED_WRAP" and not spec.transformer_layer_cls_to_wrap:
        raise DistsetupError(
            "--auto_wrap_policy TRANSFORMER_BASED_WRAP needs --transformer_layer_cls_to_wrap.",
            "name the model's block class, e.g. --transformer_layer_cls_to_wrap "
            "LlamaDecoderLayer (Block for the built-in model).",
        )
    if policy != "TRANSFORMER_BASED_WRAP" and spec.transformer_layer_cls_to_wrap:
        raise DistsetupError(
            f"--transformer_layer_cls_to_wrap is only used with TRANSFORMER_BASED_WRAP, not {policy}.",
            "drop it, or use --auto_wrap_policy TRANSFORMER_BASED_WRAP.",
        )
    if policy == "SIZE_BASED_WRAP" and spec.min_num_params is None:
        raise DistsetupError(
            "--auto_wrap_policy SIZE_BASED_WRAP needs --min_num_params.",
            "add --min_num_params 100000000 (wrap modules of at least that many parameters).",
        )
    if policy != "SIZE_BASED_WRAP" and spec.min_num_params is not None:
        raise DistsetupError(
            f"--min_num_params is only used with SIZE_BASED_WRAP, not {policy}.",
            "drop it, or use --auto_wrap_policy SIZE_BASED_WRAP.",
        )
    if spec.mixed_precision == "no" and (spec.reduce_dtype or spec.buffer_dtype):
        raise DistsetupError(
            "--reduce_dtype/--buffer_dtype need --mixed_precision FLOAT16 or BFLOAT16.",
            "add --mixed_precision BFLOAT16, or drop them.",
        )
    if spec.fsdp_version == 1 and spec.cpu_ram_efficient_loading and spec.sync_module_states is False:
        raise DistsetupError(
            "--cpu_ram_efficient_loading with --fsdp_version 1 needs --sync_module_states: "
            "other ranks start from empty weights.",
            "drop --no_sync_module_states.",
        )
    if spec.fsdp_version == 2 and spec.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        return [
            f"{spec.sharding_strategy} with FSDP2: distsetup's trainer builds the device mesh it needs, but "
            "Accelerate's FSDP2 reads only fsdp_reshard_after_forward"
            + (
                " (false = SHARD_GRAD_OP); use DDP there for no sharding."
                if spec.sharding_strategy == "NO_SHARD"
                else " and needs its own 2-D mesh (parallelism_config) for hybrid sharding."
            )
        ]
    return []


def build_fsdp_config(spec: FsdpSpec) -> dict:
    """The FSDP config dict for `spec` (call check_fsdp_spec first)."""
    config: dict = {
        "fsdp_version": spec.fsdp_version,
        "fsdp_sharding_strategy": spec.sharding_strategy,
    }
    if spec.fsdp_version == 2:
        config["fsdp_reshard_after_forward"] = RESHARDS_AFTER_FORWARD[spec.sharding_strategy]
    config["fsdp_auto_wrap_policy"] = spec.auto_wrap_policy
    if spec.transformer_layer_cls_to_wrap:
        config["fsdp_transformer_layer_cls_to_wrap"] = ",".join(spec.transformer_layer_cls_to_wrap)
    if spec.min_num_params is not None:
        config["fsdp_min_num_params"] = spec.min_num_params
    config["fsdp_state_dict_type"] = spec.state_dict_type
    config["fsdp_offload_params"] = spec.cpu_offload
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

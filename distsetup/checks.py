"""Cross-field rules for DeepSpeed and FSDP config dicts: what a schema cannot say."""

from distsetup.deepspeed_config import AUTO, warmup_too_long
from distsetup.fsdp_config import FSDP1_ONLY
from distsetup.problems import Problem, join_path, schema_problems


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


def deepspeed_problems(config: dict, world_size: int | None = None, hf: bool = False) -> list[Problem]:
    """Schema problems, then the rules DeepSpeed itself checks late, silently ignores or bends."""
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
    if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(config):
        problems.append(
            Problem(
                "train_micro_batch_size_per_gpu",
                "neither train_batch_size nor train_micro_batch_size_per_gpu is set; DeepSpeed refuses to start.",
                "set train_micro_batch_size_per_gpu (and gradient_accumulation_steps).",
            )
        )
    config = without_auto(config)
    problems += schema_problems(config, "deepspeed")
    zero = _section(config, "zero_optimization")
    stage = zero.get("stage")
    stage = stage if stage in (0, 1, 2, 3) else 0
    precision = {k for k in ("fp16", "bf16", "bfloat16") if _section(config, k).get("enabled") is True}
    if "fp16" in precision and precision & {"bf16", "bfloat16"}:
        problems.append(
            Problem(
                "bf16.enabled", "fp16 and bf16 are both enabled.", "enable one of them (bf16 on Ampere or newer GPUs)."
            )
        )
    if stage < 3:
        for key in sorted(k for k in zero if k.startswith("stage3_") or k == "offload_param"):
            problems.append(
                Problem(
                    f"zero_optimization.{key}",
                    f"means nothing at ZeRO stage {stage}: DeepSpeed ignores it silently.",
                    "set zero_optimization.stage to 3, or remove the key.",
                )
            )
    if stage == 0 and _section(zero, "offload_optimizer").get("device", "none") != "none":
        problems.append(
            Problem(
                "zero_optimization.offload_optimizer",
                "optimizer offload needs ZeRO stage 1-3.",
                "set zero_optimization.stage to 2.",
            )
        )
    for block in ("offload_optimizer", "offload_param"):
        offload = _section(zero, block)
        if offload.get("device") == "nvme" and not offload.get("nvme_path"):
            problems.append(
                Problem(
                    f"zero_optimization.{block}.nvme_path",
                    "device nvme needs nvme_path.",
                    'add "nvme_path": "/local/nvme" (a fast local disk).',
                )
            )
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


def _section(config: dict, key: str) -> dict:
    """config[key] when it is a dict, else {} (a wrong type is already a schema problem)."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _positive_int(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _batch_problems(config: dict, world_size: int | None) -> list[Problem]:
    train = _positive_int(config, "train_batch_size")
    micro = _positive_int(config, "train_micro_batch_size_per_gpu")
    accumulation = _positive_int(config, "gradient_accumulation_steps")
    if world_size is None or train is None:
        return []
    if micro is not None and accumulation is not None:
        if micro * accumulation * world_size != train:
            return [
                Problem(
                    "train_batch_size",
                    f"{train} != micro {micro} x accumulation {accumulation} x world size {world_size} "
                    f"= {micro * accumulation * world_size}.",
                    f"set train_batch_size to {micro * accumulation * world_size}, or drop it and let "
                    "DeepSpeed compute it.",
                )
            ]
        return []
    known = micro if micro is not None else (accumulation or 1)
    if train % (known * world_size):
        return [
            Problem(
                "train_batch_size",
                f"{train} is not divisible by {known} x world size {world_size}.",
                f"use a multiple of {known * world_size}.",
            )
        ]
    return []


def fsdp_problems(config: dict) -> list[Problem]:
    """Schema problems, then options that mean nothing for the file's fsdp_version or wrap policy."""
    problems = schema_problems(config, "fsdp")
    version = config.get("fsdp_version")
    if version == 2:
        for name, why in FSDP1_ONLY.items():
            if f"fsdp_{name}" in config:
                problems.append(
                    Problem(
                        f"fsdp_{name}",
                        f"means nothing with fsdp_version 2: FSDP2 {why}.",
                        "remove it, or set fsdp_version: 1.",
                    )
                )
        if config.get("fsdp_state_dict_type") == "LOCAL_STATE_DICT":
            problems.append(
                Problem("fsdp_state_dict_type", "LOCAL_STATE_DICT does not exist in FSDP2.", "use SHARDED_STATE_DICT.")
            )
    policy = config.get("fsdp_auto_wrap_policy", "NO_WRAP")
    if policy == "TRANSFORMER_BASED_WRAP" and "fsdp_transformer_layer_cls_to_wrap" not in config:
        problems.append(
            Problem(
                "fsdp_transformer_layer_cls_to_wrap",
                "TRANSFORMER_BASED_WRAP needs the block class to wrap.",
                'add e.g. "fsdp_transformer_layer_cls_to_wrap": "Block".',
            )
        )
    if policy == "SIZE_BASED_WRAP" and "fsdp_min_num_params" not in config:
        problems.append(
            Problem(
                "fsdp_min_num_params",
                "SIZE_BASED_WRAP needs fsdp_min_num_params.",
                'add e.g. "fsdp_min_num_params": 100000000.',
            )
        )
    if config.get("mixed_precision", "no") == "no":
        for key in ("fsdp_reduce_dtype", "fsdp_buffer_dtype"):
            if key in config:
                problems.append(
                    Problem(
                        key,
                        "means nothing without mixed_precision.",
                        "set mixed_precision to bf16 or fp16, or remove it.",
                    )
                )
    return problems

"""What DeepSpeed 0.19 refuses to start with, though the schema takes it: the blocks it removed, the batch keys it
hands the DataLoader as written, and the settings its config classes refuse at the file's ZeRO stage
(runtime/config.py, runtime/zero/config.py). Asked by deepspeed_rules.deepspeed_problems."""

import math

from distsetup.formats.deepspeed import AUTO, section_of, zero_stage_of
from distsetup.formats.problems import Problem, wrong_type

# Blocks DeepSpeed 0.19 removed and refuses to start with (runtime/config.py, _reject_removed_config_keys): key -> the
# way now, if there is one
REMOVED = {
    "amp": "use bf16 or fp16 (or torch_autocast)",
    "elasticity": "set the batch keys directly",
    "curriculum_learning": "use data_efficiency.data_sampling.curriculum_learning",
    **dict.fromkeys(
        "nebula compression_training quantize_training sparse_gradients eigenvalue sparse_attention "
        "graph_harvesting progressive_layer_drop".split(),
        "",
    ),
    **dict.fromkeys(
        ("zero_optimization.mics_shard_size", "zero_optimization.mics_hierarchical_params_gather"),
        "MiCS is gone: use zero_optimization.stage 3",
    ),
}
# The batch keys DeepSpeed reads as they are written and hands the DataLoader (batch_size=2.0 is refused there)
RAW_INTEGERS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Optimizer types ZeRO trains with (runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS: torch's and DeepSpeed's Adam,
# AdamW, Adagrad and Lion, as runtime/engine.py _configure_basic_optimizer builds them; and Muon, its own); with any
# other (SGD, Lamb, ...) DeepSpeed stops at start unless zero_allow_untested_optimizer is true (engine.py
# _do_optimizer_sanity_check)
ZERO_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion", "muon")
# Settings DeepSpeed refuses at ZeRO stage 0 (section, key)
ZERO_STAGES_ONLY = (
    ("fp16", "fp16_master_weights_and_grads"),
    ("bf16", "bf16_master_weights_and_grads"),
    ("bf16", "bf16_optimizer_states"),
)


def refused_at_start(config: dict) -> list[Problem]:
    """Each of the file's settings DeepSpeed 0.19 refuses to start with ("auto" values already taken out)."""
    return _removed_and_raw_problems(config) + _refused_at_the_stage(config)


def _removed_and_raw_problems(config: dict) -> list[Problem]:
    """Blocks DeepSpeed has removed (it refuses the file), and batch keys written as floats (the DataLoader refuses
    them; JSON Schema counts 8.0 as an integer; NaN and infinities are said as such elsewhere)."""
    problems = []
    for path, way in REMOVED.items():
        section, _, key = path.rpartition(".")
        if key in (section_of(config, section) if section else config):
            said = f"; {way}" if way else ""
            problems.append(Problem(path, f"was removed from DeepSpeed: 0.19 refuses the file{said}.", "remove it."))
    for key in RAW_INTEGERS:
        value = config.get(key)
        if isinstance(value, float) and math.isfinite(value) and (found := wrong_type(key, value, int, "DeepSpeed")):
            problems.append(found)
    return problems


def _refused_at_the_stage(config: dict) -> list[Problem]:
    """Settings DeepSpeed 0.19 refuses when its config is read (runtime/config.py, runtime/zero/config.py), at the
    ZeRO stage the file has."""
    stage, zero = zero_stage_of(config), section_of(config, "zero_optimization")
    bf16 = section_of(config, "bf16")
    optimizer = section_of(config, "optimizer").get("type")
    ratio = section_of(zero, "offload_optimizer").get("ratio")
    keep = section_of(config, "data_types").get("keep_in_fp32_modules", AUTO)
    patterns = keep == AUTO or (isinstance(keep, list) and all(isinstance(name, str) for name in keep))
    refused = [
        (
            "zero_optimization.compute_grad_norm",
            zero.get("compute_grad_norm") is False and stage not in (1, 2),
            "false is supported at ZeRO stage 1 or 2 only",
            "remove it, or use stage 1 or 2",
        ),
        (
            "zero_optimization.offload_optimizer.ratio",
            isinstance(ratio, int | float) and ratio < 1 and stage != 3,
            "below 1 (a partial offload) is supported at ZeRO stage 3 only",
            "remove it, or use stage 3",
        ),
        (
            "gradient_allreduce_op",
            config.get("gradient_allreduce_op") == "sum" and stage == 3,
            "'sum' is not supported at ZeRO stage 3",
            "remove it (gradients are averaged), or use stage 1 or 2",
        ),
        *(
            (
                f"{section}.{key}",
                section_of(config, section).get(key) is True and stage == 0,
                "is supported at ZeRO stage 1, 2 or 3 only",
                "remove it, or use stage 1 or more",
            )
            for section, key in ZERO_STAGES_ONLY
        ),
        (
            "bf16.bf16_optimizer_states",
            bf16.get("bf16_optimizer_states") is True
            and stage != 0
            and bf16.get("bf16_master_weights_and_grads") is not True,
            "needs bf16.bf16_master_weights_and_grads",
            "set bf16_master_weights_and_grads to true, or remove it",
        ),
        (
            "optimizer.type",
            isinstance(optimizer, str)
            and optimizer.lower() not in ZERO_OPTIMIZERS
            and stage != 0
            and config.get("zero_allow_untested_optimizer") is not True,
            f"{optimizer} is no optimizer ZeRO has been tested with",
            "use AdamW (or Adam, Adagrad, Lion); for one of torch.optim's (SGD, RMSprop, ...), set "
            '"zero_allow_untested_optimizer": true',
        ),
        (
            "data_types.keep_in_fp32_modules",
            not patterns,
            f'{keep!r} is neither "auto" nor a list of name patterns',
            'write "auto" or a list such as ["norm"]',
        ),
    ]
    return [
        Problem(path, f"{message}: DeepSpeed 0.19 refuses the file.", f"{fix}.")
        for path, broken, message, fix in refused
        if broken
    ]

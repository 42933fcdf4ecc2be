"""The optimizer's and the scheduler's `params` in a DeepSpeed file, as DeepSpeed 0.19 hands them on: as keyword
arguments to the class it builds (runtime/engine.py _configure_basic_optimizer, runtime/lr_schedules.py), which stops
at start on a key it does not take, on a number written as text or on a step count it refuses, and trains on with a
negative rate. Each class's
keys are its constructor's (DeepSpeed 0.19.8, torch 2.13); an optimizer DeepSpeed hands to torch by another name (SGD,
...) or builds from another package is left to its class."""

import dataclasses

from distsetup.formats.deepspeed import AUTO, offload_device, section_of
from distsetup.formats.problems import Problem, schema_problems_in

RATE = {"type": "number", "minimum": 0}  # a rate, a ratio or a decay: torch refuses a negative one, FusedAdam climbs
FLAG = {"type": "boolean"}
STEPS = {"type": "integer", "minimum": 0}
POSITIVE_STEPS = {"type": "integer", "minimum": 1}  # "must be a positive integer" (lr_schedules.py)
SOME_STEPS = {"type": ["integer", "null"], "minimum": 0}
# a scheduler's rate: one for every parameter group, or a list of one each (_format_param); WarmupLR's max null: each
# group's own lr
PER_GROUP = {"type": ["number", "array", "null"], "minimum": 0, "items": RATE}
MAYBE = {"type": ["boolean", "null"]}  # torch's None: its own choice
ITERATION = {"type": "integer", "minimum": -1}
BETAS = {
    "type": "array",
    "items": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    "minItems": 2,
    "maxItems": 2,
    "description": "two numbers from 0 up to 1, e.g. [0.9, 0.999]",
}

# what DeepSpeed takes out of an Adam's params before it builds one (engine.py get_optimizer_configuration)
ADAM_SWITCHES = {"adam_w_mode": FLAG, "torch_adam": FLAG, "fp32_optimizer_states": FLAG}
ADAM = {"lr": RATE, "betas": BETAS, "eps": RATE, "weight_decay": RATE, "amsgrad": FLAG, **ADAM_SWITCHES}
TORCH_EXTRAS = {"maximize": FLAG, "foreach": MAYBE, "capturable": FLAG, "differentiable": FLAG, "fused": MAYBE}
# optimizer (DeepSpeed's lower-case name) -> where it is built (on the device; cpu: the optimizer offloaded; torch:
# torch_adam true, torch_adam_no_w: and adam_w_mode false) -> (the class DeepSpeed builds, the keys it takes)
OPTIMIZERS: dict[str, dict[str, tuple[str, dict]]] = {
    "adam": {
        # FusedAdam stops on amsgrad true ("does not support the AMSGrad variant")
        "device": ("FusedAdam", {**ADAM, "amsgrad": {"enum": [False]}, "bias_correction": FLAG, "set_grad_none": FLAG}),
        "cpu": ("DeepSpeedCPUAdam", {**ADAM, "bias_correction": FLAG}),
        "torch": ("torch.optim.AdamW", {**ADAM, **TORCH_EXTRAS}),
        "torch_adam_no_w": ("torch.optim.Adam", {**ADAM, **TORCH_EXTRAS, "decoupled_weight_decay": FLAG}),
    },
    "adagrad": {
        "device": (
            "torch.optim.Adagrad",
            {"lr": RATE, "lr_decay": RATE, "weight_decay": RATE, "initial_accumulator_value": RATE, "eps": RATE}
            | {"foreach": FLAG, "maximize": FLAG, "differentiable": FLAG, "fused": FLAG},
        ),
        "cpu": (
            "DeepSpeedCPUAdagrad",
            {"lr": RATE, "eps": RATE, "weight_decay": RATE, "amsgrad": FLAG, "fp32_optimizer_states": FLAG},
        ),
    },
    "lion": {
        "device": ("FusedLion", {"lr": RATE, "betas": BETAS, "weight_decay": RATE, "set_grad_none": FLAG}),
        "cpu": ("DeepSpeedCPULion", {"lr": RATE, "betas": BETAS, "weight_decay": RATE, "fp32_optimizer_states": FLAG}),
    },
    "lamb": {  # wherever the optimizer is
        "device": (
            "FusedLamb",
            {"lr": RATE, "bias_correction": FLAG, "betas": BETAS, "eps": RATE, "eps_inside_sqrt": FLAG}
            | {"weight_decay": RATE, "max_coeff": RATE, "min_coeff": RATE, "amsgrad": FLAG},
        ),
    },
}
OPTIMIZERS["adamw"] = OPTIMIZERS["adam"]

WARMUP_TYPE = {"type": "string"}  # log or linear; another: a warning, and log
WARMUP = {
    "warmup_min_lr": PER_GROUP,
    "warmup_max_lr": PER_GROUP,
    "warmup_num_steps": POSITIVE_STEPS,
    "warmup_type": WARMUP_TYPE,
}
# scheduler -> (the keys it takes, the ones it needs)
SCHEDULERS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "WarmupLR": ({**WARMUP, "last_batch_iteration": ITERATION}, ()),
    "WarmupDecayLR": ({**WARMUP, "total_num_steps": STEPS, "last_batch_iteration": ITERATION}, ("total_num_steps",)),
    "WarmupCosineLR": (
        {"total_num_steps": STEPS, "warmup_min_ratio": RATE, "warmup_num_steps": POSITIVE_STEPS, "cos_min_ratio": RATE}
        | {"warmup_type": WARMUP_TYPE, "last_batch_iteration": ITERATION},
        ("total_num_steps",),
    ),
    "OneCycle": (
        {"cycle_min_lr": PER_GROUP, "cycle_max_lr": PER_GROUP, "decay_lr_rate": RATE}
        | {"cycle_first_step_size": POSITIVE_STEPS}
        | {"cycle_second_step_size": SOME_STEPS, "cycle_first_stair_count": STEPS}
        | {"cycle_second_stair_count": SOME_STEPS, "decay_step_size": STEPS, "cycle_momentum": FLAG}
        | {"cycle_min_mom": PER_GROUP, "cycle_max_mom": PER_GROUP, "decay_mom_rate": RATE}
        | {"last_batch_iteration": ITERATION},
        ("cycle_min_lr", "cycle_max_lr"),
    ),
    "LRRangeTest": (
        {"lr_range_test_min_lr": PER_GROUP, "lr_range_test_step_size": POSITIVE_STEPS, "lr_range_test_step_rate": RATE}
        | {"lr_range_test_staircase": FLAG, "last_batch_iteration": ITERATION},
        (),
    ),
}


def params_problems(config: dict) -> list[Problem]:
    """Problems of the optimizer's and the scheduler's params against the class DeepSpeed builds of them ("auto":
    the HF Trainer's to fill, said elsewhere)."""
    optimizer, scheduler = section_of(config, "optimizer"), section_of(config, "scheduler")
    problems = []
    name = str(optimizer.get("type", "")).lower()
    if name in OPTIMIZERS:
        params = section_of(optimizer, "params")
        places = OPTIMIZERS[name]
        device = section_of(section_of(config, "zero_optimization"), "offload_optimizer").get("device")
        if device == AUTO and "cpu" in places and params.get("torch_adam") is not True:  # Accelerate's to decide
            (on_device, device_keys), (on_cpu, cpu_keys) = places["device"], places["cpu"]
            built, keys = f"{on_device} or {on_cpu}", {**device_keys, **cpu_keys}  # what either takes
        else:
            built, keys = places[
                _where_built(name, params, offload_device(config, "offload_optimizer") in ("cpu", "nvme"))
            ]
        problems += _against("optimizer.params", params, keys, built)
    if isinstance(scheduler.get("type"), str) and scheduler["type"] in SCHEDULERS:  # else a schema problem
        params = section_of(scheduler, "params")
        keys, needed = SCHEDULERS[scheduler["type"]]
        problems += _against("scheduler.params", params, keys, scheduler["type"])
        problems += [
            Problem(
                f"scheduler.params.{key}",
                f"is missing: {scheduler['type']} needs it, and DeepSpeed stops at start without it.",
                "add it (total_num_steps: the run's optimizer steps).",
            )
            for key in needed
            if key not in params
        ]
    return problems


def _where_built(name: str, params: dict, offloaded: bool) -> str:
    """Where DeepSpeed builds the optimizer `name` (a key of OPTIMIZERS[name])."""
    if name in ("adam", "adamw") and params.get("torch_adam") is True:
        # Adam forces AdamW's decoupled weight decay unless adam_w_mode is false (engine.py)
        return "torch_adam_no_w" if name == "adam" and params.get("adam_w_mode") is False else "torch"
    return "cpu" if offloaded and "cpu" in OPTIMIZERS[name] else "device"


def _against(where: str, params: dict, keys: dict, built: str) -> list[Problem]:
    """The params' problems against the keys of the class DeepSpeed builds (`built`, named for an unknown key)."""
    given = {key: value for key, value in params.items() if value != AUTO}
    schema = {"type": "object", "properties": keys, "additionalProperties": False}

    def hint(section: str, key: str, known) -> str | None:
        if key == "max_grad_norm":
            return "remove it and set the top-level gradient_clipping (DeepSpeed refuses max_grad_norm here)."
        return None

    found = schema_problems_in(given, schema, hint)
    unknown = (
        f" DeepSpeed hands the params to {built} as keyword arguments, which stops at start on one it does not take."
    )
    return [
        dataclasses.replace(
            problem,
            path=f"{where}.{problem.path}" if problem.path else where,
            message=problem.message + (unknown if problem.message.startswith("unknown key") else ""),
        )
        for problem in found
    ]

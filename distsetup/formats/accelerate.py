"""An Accelerate config YAML (what `accelerate config` writes, `accelerate launch --config_file` reads): its
keys, the world it describes, and the FSDP and DeepSpeed blocks inside it, checked as Accelerate reads them
(accelerate 1.x: `ClusterConfig`, `accelerate launch`, `DeepSpeedPlugin`)."""

import os
from pathlib import Path

from distsetup.formats.deepspeed import OFFLOAD_DEVICES, DeepSpeedSpec, accelerate_zero_stage
from distsetup.formats.deepspeed_rules import AccelerateWords, violations, worded
from distsetup.formats.fsdp_rules import accelerate_yaml_fsdp_problems
from distsetup.formats.problems import Problem, suggest, wrong_type

# ClusterConfig's fields; Accelerate refuses any other top-level key ("had unknown keys"), save the two old
# spellings its process_config converts (fp16, dynamo_backend).
KEYS = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "mixed_precision",
        "use_cpu",
        "debug",
        "num_processes",
        "machine_rank",
        "num_machines",
        "gpu_ids",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "main_training_function",
        "enable_cpu_affinity",
        "fp8_config",
        "deepspeed_config",
        "fsdp_config",
        "parallelism_config",
        "megatron_lm_config",
        "mpirun_config",
        "downcast_bf16",
        "tpu_name",
        "tpu_zone",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "command_file",
        "commands",
        "tpu_vm",
        "tpu_env",
        "dynamo_config",
    }
)
OLD_KEYS = frozenset({"fp16", "dynamo_backend"})
# Keys an older `accelerate config` wrote and Accelerate refuses now: a near spelling of another key is no fix.
DROPPED_KEYS = frozenset({"ipex_config", "use_mps_device"})
DISTRIBUTED_TYPES = frozenset(
    {
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_XPU",
        "MULTI_HPU",
        "MULTI_NEURON",
        "DEEPSPEED",
        "FSDP",
        "XLA",
        "MEGATRON_LM",
    }
)
MIXED_PRECISIONS = frozenset({"no", "fp16", "bf16", "fp8"})
# The deepspeed_config block as `accelerate launch` reads it (its --<key> flags).
DEEPSPEED_KEYS = frozenset(
    {
        "deepspeed_config_file",
        "zero_stage",
        "offload_optimizer_device",
        "offload_param_device",
        "offload_optimizer_nvme_path",
        "offload_param_nvme_path",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero3_init_flag",
        "zero3_save_16bit_model",
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_exclusion_filter",
        "deepspeed_inclusion_filter",
        "deepspeed_moe_layer_cls_names",
    }
)
# Beside deepspeed_config_file these belong in the DeepSpeed file: DeepSpeedPlugin raises ValueError ("When
# using `deepspeed_config_file`, the following accelerate config variables will be ignored").
IGNORED_BESIDE_FILE = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
)
WHOLE_NUMBERS = ("num_processes", "num_machines", "machine_rank", "main_process_port")


def is_accelerate_config(data: dict) -> bool:
    return "distributed_type" in data or "compute_environment" in data


def accelerate_problems(
    data: dict, num_gpus_per_node: int | None = None, world_size: int | None = None
) -> list[Problem]:
    """Every place `accelerate launch` would refuse the file or run something else than it says; the world is
    `world_size` processes, or num_machines x `num_gpus_per_node`."""
    problems = [
        Problem(
            str(key),
            'Accelerate refuses unknown keys ("had unknown keys").',
            "remove it: an older `accelerate config` wrote it, Accelerate no longer reads it."
            if key in DROPPED_KEYS
            else suggest(str(key), KEYS),
        )
        for key in data
        if key not in KEYS | OLD_KEYS
    ]
    kind = data.get("distributed_type")
    if kind is None:
        problems.append(Problem("distributed_type", "is missing; Accelerate refuses the file.", "e.g. MULTI_GPU."))
    elif not isinstance(kind, str) or kind not in DISTRIBUTED_TYPES:
        problems.append(
            Problem(
                "distributed_type",
                f"{kind!r} is not one Accelerate knows.",
                suggest(str(kind), DISTRIBUTED_TYPES, "values"),
            )
        )
    precision = data.get("mixed_precision")
    if precision is not None and (not isinstance(precision, str) or precision not in MIXED_PRECISIONS):
        problems.append(
            Problem("mixed_precision", f"{precision!r} is not one Accelerate knows.", "use no, fp16, bf16 or fp8.")
        )
    wrong = [
        problem
        for key in WHOLE_NUMBERS
        if data.get(key) is not None and (problem := wrong_type(key, data[key], int, "accelerate launch")) is not None
    ]
    problems += wrong or _world_problems(data, num_gpus_per_node, world_size) + _cpu_world_problems(data)
    problems += _block_problems(data, kind)
    return problems


def _world_problems(data: dict, num_gpus_per_node: int | None, world_size: int | None) -> list[Problem]:
    processes = data.get("num_processes")
    machines = data.get("num_machines")
    machines = 1 if machines is None else machines
    rank = data.get("machine_rank") or 0
    if machines < 1:
        return [Problem("num_machines", f"{machines} machines.", "at least 1.")]
    problems = []
    if not 0 <= rank < machines:
        problems.append(
            Problem("machine_rank", f"{rank} is not a rank of {machines} machine(s).", f"0 to {machines - 1}.")
        )
    expected = world_size or (machines * num_gpus_per_node if num_gpus_per_node else None)
    if processes is not None and processes > 0:
        if expected is not None and processes != expected:
            per_machine = (
                " (it counts processes over all machines, not per machine)"
                if machines > 1 and processes * machines == expected
                else ""
            )
            given = (
                f"the world size {world_size}" if world_size else f"{machines} machine(s) x {num_gpus_per_node} GPUs"
            )
            problems.append(
                Problem(
                    "num_processes",
                    f"{processes} is not {given} = {expected}{per_machine}.",
                    f"num_processes: {expected}.",
                )
            )
        elif processes % machines:
            problems.append(
                Problem(
                    "num_processes",
                    f"{processes} processes do not split evenly over {machines} machines: num_processes is the "
                    "total over all machines.",
                    "num_machines x GPUs per machine.",
                )
            )
    if machines > 1 and not data.get("main_process_ip"):
        problems.append(
            Problem(
                "main_process_ip",
                f"is missing with {machines} machines: the other machines cannot find the main one.",
                "the address of machine 0, reachable from every machine.",
            )
        )
    return problems


def _cpu_world_problems(data: dict) -> list[Problem]:
    """MULTI_CPU: on CPUs `accelerate launch` starts more than one process only through mpirun; without it, its
    simple launcher starts one, whatever num_processes says (accelerate 1.15, commands/launch.py launch_command)."""
    processes, mpirun = data.get("num_processes") or 1, data.get("mpirun_config")
    if data.get("distributed_type") != "MULTI_CPU" or processes <= 1:
        return []
    if isinstance(mpirun, dict) and mpirun.get("mpirun_hostfile"):
        return []
    return [
        Problem(
            "mpirun_config",
            f"has no mpirun_hostfile with distributed_type MULTI_CPU: `accelerate launch` starts 1 process, not "
            f"num_processes {processes} (on CPUs only mpirun starts more).",
            "give mpirun_config.mpirun_hostfile, as `accelerate config` asks; or let `distsetup launcher "
            "--launch_method accelerate` write a script that starts the CPU processes through torchrun.",
        )
    ]


def _block_problems(data: dict, kind) -> list[Problem]:
    problems = []
    for block, owner in (("fsdp_config", "FSDP"), ("deepspeed_config", "DEEPSPEED")):
        if data.get(block) is not None and not isinstance(data[block], dict):
            problems.append(Problem(block, f"{data[block]!r} is not a mapping of keys.", f"write {block}: as keys."))
        elif data.get(block) and kind != owner and kind in DISTRIBUTED_TYPES:  # an unknown kind is said once
            problems.append(
                Problem(
                    block,
                    f"is ignored: distributed_type is {kind}, so `accelerate launch` does not read it.",
                    f"set distributed_type: {owner}, or remove the block.",
                )
            )
    fsdp = data.get("fsdp_config")
    if kind == "FSDP" and isinstance(fsdp, dict):
        # without fsdp_version Accelerate runs FSDP1
        found = accelerate_yaml_fsdp_problems({"fsdp_version": 1, **fsdp}, data.get("mixed_precision"))
        problems += [Problem(f"fsdp_config.{p.path}".rstrip("."), p.message, p.fix) for p in found]
    deepspeed = data.get("deepspeed_config")
    if kind == "DEEPSPEED" and isinstance(deepspeed, dict):
        problems += deepspeed_block_problems(deepspeed, data.get("mixed_precision"))
    return problems


def deepspeed_block_problems(block: dict, mixed_precision) -> list[Problem]:
    """The deepspeed_config block's problems; `mixed_precision`: the config's top-level value (None: not set)."""
    problems = [
        Problem(f"deepspeed_config.{key}", "is not a key `accelerate launch` reads.", suggest(str(key), DEEPSPEED_KEYS))
        for key in block
        if key not in DEEPSPEED_KEYS
    ]
    if block.get("deepspeed_config_file"):
        beside = [key for key in IGNORED_BESIDE_FILE if key in block]
        beside += ["mixed_precision"] if mixed_precision is not None else []
        problems += [
            Problem(
                key if key == "mixed_precision" else f"deepspeed_config.{key}",
                'beside deepspeed_config_file: Accelerate stops ("the following accelerate config variables will '
                'be ignored").',
                "set it in the DeepSpeed file and remove it here.",
            )
            for key in beside
        ]
        return problems
    stage = block.get("zero_stage")
    if stage is not None and accelerate_zero_stage(stage) is None:
        problems.append(Problem("deepspeed_config.zero_stage", f"{stage!r} is not a ZeRO stage.", "0, 1, 2 or 3."))
    for key in ("offload_optimizer_device", "offload_param_device"):
        device = block.get(key)
        if device is not None and device not in OFFLOAD_DEVICES:
            problems.append(Problem(f"deepspeed_config.{key}", f"{device!r} is not a device.", "none, cpu or nvme."))
    # the rules of a DeepSpeed file and of `distsetup deepspeed`'s flags, in Accelerate's keys
    spec = DeepSpeedSpec.from_accelerate(block, mixed_precision)
    problems += [Problem(*worded(v, AccelerateWords())) for v in violations(spec)]
    return problems


def default_config() -> Path:
    """Where `accelerate config` writes the config that every `accelerate launch` without --config_file reads:
    in $HF_HOME, else in $XDG_CACHE_HOME/huggingface, else in ~/.cache/huggingface (accelerate's config_args.py)."""
    cache = os.environ.get("XDG_CACHE_HOME", "~/.cache")
    return (
        Path(os.environ.get("HF_HOME", os.path.join(cache, "huggingface"))).expanduser()
        / "accelerate/default_config.yaml"
    )


def own_program_notes(deepspeed_config: dict, path: str) -> list[str]:
    """What `accelerator.prepare` refuses in a program of the user's, beside a DeepSpeed file that names an optimizer
    or a scheduler: one the program makes itself (the HF Trainer makes accelerate's stand-ins for them)."""
    blocks = [block for block in ("optimizer", "scheduler") if isinstance(deepspeed_config.get(block), dict)]
    return [
        f"{path} names a DeepSpeed {block}: accelerator.prepare refuses one your program makes itself (use "
        f"accelerate.utils.Dummy{'Optim' if block == 'optimizer' else 'Scheduler'}, or write the file without it: "
        f"`distsetup deepspeed --{block} none`); the HF Trainer takes either."
        for block in blocks
    ]


def default_config_note(path: Path) -> str | None:
    """The default config is read by every `accelerate launch` without --config_file, long after it was written."""
    try:
        is_default = path.resolve() == default_config().resolve()
    except OSError:
        return None
    if not is_default:
        return None
    return (
        "this is Accelerate's default config: `accelerate launch` without --config_file uses it for every run "
        "(a leftover FSDP or DeepSpeed setting here applies to all of them)."
    )

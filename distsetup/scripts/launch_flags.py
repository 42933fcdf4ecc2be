"""The launch flags a user types that need more than Click's types: --gpus (indices, or auto:N) and --env
(KEY=VALUE pairs, none of the variables the scripts, their engines or torchrun set themselves)."""

import re

from distsetup.errors import DistsetupError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What the scripts that take --env (distsetup slurm, distsetup job) set themselves, from their flags or their engine,
# before or after the --env exports: a --env value would change the world they start (NNODES=5 on 2 nodes waits at
# the rendezvous) or the program they run. A test reads the templates for any variable missing here.
SCRIPT_VARIABLES: dict[str, str | None] = {
    "NNODES": "--num_nodes",
    "NPROC_PER_NODE": "--num_gpus_per_node",
    "MASTER_PORT": "--master_port",
    "MASTER_ADDR": "the engine (SLURM's first node, the job's node 0)",
    "NODE_RANK": "the engine (SLURM_NODEID, the pod's index)",
    "RDZV_ID": "the job's id",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "--grace_seconds (distsetup job) or --signal_seconds (distsetup slurm)",
    **dict.fromkeys(
        "DISTSETUP_PREEMPTED_FILE PREEMPTION_DIR GPUS_FOUND HOSTFILE HOSTS JOB_TIME_LIMIT LAUNCH LAUNCHER_PID "
        "RUNNER_PID SRUN_ARGS SRUN_PID TRAIN_ARGS SCRIPT MODULE WORKDIR PYTHON DEEPSPEED_CONFIG "
        "ACCELERATE_FSDP_ARGS CHECKED_WORLD".split(),
        None,  # its own working variables
    ),
}


# What the engines set in each node or pod, and torchrun in each rank, that the scripts read: an --env value would
# be overwritten, or not be the one read (the entry point reads JOB_COMPLETION_INDEX before the --env exports); and
# what the environment flags export (an --env of the same variable beside its flag: two values, the later silent).
# Other SLURM_ and PET_ variables are input a user may set on purpose (SLURM_CPU_BIND for srun, PET_TEE for torchrun).
ENGINE_VARIABLES: dict[str, str] = {
    "JOB_COMPLETION_INDEX": "Kubernetes (an indexed Job's pod index)",
    **dict.fromkeys(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), "torchrun (each rank's)"),
    **dict.fromkeys(
        ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE"), "SkyPilot"
    ),
    **dict.fromkeys(
        ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
        "Kubeflow (its torchrun settings)",
    ),
    **dict.fromkeys(("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID"), "SLURM"),
}
FLAG_VARIABLES = {
    "OMP_NUM_THREADS": "omp_num_threads",
    "NCCL_DEBUG": "nccl_debug",
    "NCCL_SOCKET_IFNAME": "nccl_socket_ifname",
    "NCCL_IB_DISABLE": "nccl_ib_disable",
    "CUDA_DEVICE_MAX_CONNECTIONS": "cuda_device_max_connections",
}


def parse_gpus(text: str) -> tuple[int, ...] | int:
    """'0,1' -> (0, 1); 'auto:N' -> N (the caller picks N GPUs); anything else is an error."""
    text = text.strip()
    if text.startswith("auto:"):
        count = text[5:]
        if not count.isdigit() or int(count) < 1:
            raise DistsetupError(f"--gpus {text}: auto:N needs a positive N.", "write e.g. --gpus auto:4.")
        return int(count)
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise DistsetupError(f"--gpus {text} is not a list of GPU indices.", "write e.g. --gpus 0,1 or --gpus auto:2.")
    ids = tuple(int(p) for p in parts)
    if len(set(ids)) != len(ids):
        raise DistsetupError(f"--gpus {text} names a GPU twice.", "list each GPU index once.")
    return ids


def parse_env_pairs(pairs, option: str = "--env") -> tuple[tuple[str, str], ...]:
    """KEY=VALUE strings -> pairs, with KEY a valid shell variable name that the script does not set itself."""
    result = []
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise DistsetupError(
                f"{option} '{item}' is not KEY=VALUE with KEY a variable name.",
                f"write e.g. {option} WANDB_MODE=offline.",
            )
        if key in SCRIPT_VARIABLES:
            source = SCRIPT_VARIABLES[key]
            flag = f" and give {source}" if source and source.startswith("--") else ""
            raise DistsetupError(
                f"{option} {key}=...: the script sets {key} itself{f', from {source}' if source else ''}.",
                f"drop {option} {key}{flag}.",
            )
        if setter := ENGINE_VARIABLES.get(key):
            raise DistsetupError(f"{option} {key}=...: {setter} sets {key} itself.", f"drop {option} {key}.")
        result.append((key, value))
    return tuple(result)

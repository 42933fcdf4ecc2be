"""The launch scripts' environment block: the variables a run may need set (threads, NCCL, the --env ones), each
with why; those left unset are shown commented out, with an example value."""

from dataclasses import dataclass

NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


@dataclass(frozen=True)
class EnvSpec:
    """The environment block; None leaves a variable unset (the script shows it commented out)."""

    omp_num_threads: int | None = None
    nccl_debug: str | None = None
    nccl_socket_ifname: str | None = None
    nccl_ib_disable: bool | None = None
    timeout_minutes: int | None = None
    cuda_device_max_connections: int | None = None
    extra: tuple[tuple[str, str], ...] = ()


# What each launcher gives its processes where OMP_NUM_THREADS is unset (torch.distributed.run, accelerate's
# utils/launch.py, deepspeed's launcher/launch.py)
OMP_WHEN_UNSET = {
    "torchrun": "torchrun sets 1 when unset",
    "accelerate": "accelerate sets 1 when unset, or with its --cpu the cores over the processes",
    "deepspeed": "the deepspeed launcher leaves it unset: each process then takes every core",
}


def environment_lines(env: EnvSpec, launch_method: str) -> list[dict]:
    """The environment block: each variable with its explanation; unset ones are shown commented out."""

    def var(name, value, example, why):
        return {"name": name, "value": None if value is None else str(value), "example": example, "why": why}

    ib = None if env.nccl_ib_disable is None else int(env.nccl_ib_disable)
    lines = [
        var("OMP_NUM_THREADS", env.omp_num_threads, "1", f"CPU threads per process ({OMP_WHEN_UNSET[launch_method]})"),
        var("NCCL_DEBUG", env.nccl_debug, "INFO", "NCCL logging: WARN, INFO (connection set-up), TRACE"),
        var("NCCL_SOCKET_IFNAME", env.nccl_socket_ifname, "eth0", "network interface NCCL uses between nodes"),
        var("NCCL_IB_DISABLE", ib, "1", "1 = no InfiniBand (use TCP sockets)"),
        var(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            None if env.timeout_minutes is None else 2,
            "2",
            "a collective that times out raises in each rank, which says so, instead of hanging (1, 3: NCCL ends it)",
        ),
        var(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            env.cuda_device_max_connections,
            "1",
            "1 lets tensor-parallel compute and communication overlap",
        ),
    ]
    lines += [var(name, value, value, "set with --env") for name, value in env.extra]
    return lines

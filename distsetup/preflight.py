"""Preflight: every rank joins the process group, all-reduces and meets at a barrier, with a short timeout.

Run it the way training will run, in front of the real job:

    torchrun --nproc_per_node 4 -m distsetup.preflight --timeout 30
    srun torchrun --nnodes "$SLURM_NNODES" ... -m distsetup.preflight

It reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun sets them, uses NCCL when
the rank sees a GPU and gloo otherwise, and checks the all-reduce result (not just that it returned).
A failure prints one line naming the rank, host, master address and port, and exits 1 within about
--timeout seconds; rank 0 prints one OK line with the timings.
"""

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

from distsetup.errors import first_line
from distsetup.training.launch_env import read_world

EXIT_FAILED = 1


def where() -> dict:
    """Who this process is, from torchrun's (or srun's) environment, read by the trainer's one reader."""
    world = read_world(srun_stands_in=True)
    return {
        "rank": world.rank,
        "world_size": world.size,
        "local_rank": world.local_rank,
        "host": socket.gethostname(),
        "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "master_port": os.environ.get("MASTER_PORT", "29500"),
    }


def failure(info: dict, backend: str, stage: str, error: BaseException | str) -> str:
    detail = first_line(error, limit=2000) if isinstance(error, BaseException) else error.strip()  # NCCL's are long
    detail = detail.rstrip(".")
    return (
        f"preflight FAILED: rank {info['rank']}/{info['world_size']} (local rank {info['local_rank']}) on host "
        f"{info['host']}: {stage} with master {info['master_addr']}:{info['master_port']} (backend {backend}): "
        f"{detail}. HINT: check that MASTER_ADDR is the first node's address reachable from {info['host']}, "
        f"that port {info['master_port']} is open and free there, and that every node started the same job."
    )


def run(timeout: float, size_mb: float) -> int:
    info = where()
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    stage = "resolving the master address"
    try:
        socket.getaddrinfo(info["master_addr"], int(info["master_port"]))
        if use_cuda:
            torch.cuda.set_device(info["local_rank"])
        device = torch.device("cuda", info["local_rank"]) if use_cuda else torch.device("cpu")
        stage = "joining the process group"
        t0 = time.perf_counter()
        dist.init_process_group(
            backend,
            rank=info["rank"],
            world_size=info["world_size"],
            init_method=f"tcp://{_bracket(info['master_addr'])}:{info['master_port']}"
            if "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
            else "env://",
            timeout=timedelta(seconds=timeout),
            device_id=device if use_cuda else None,
        )
        t_init = time.perf_counter() - t0
        stage = "all-reduce"
        numel = max(1, int(size_mb * 1e6 / 4))
        tensor = torch.ones(numel, dtype=torch.float32, device=device)
        dist.all_reduce(tensor)  # warm-up: connections are made lazily
        tensor.fill_(info["rank"] + 1)
        if use_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        if use_cuda:
            torch.cuda.synchronize()
        t_reduce = time.perf_counter() - t0
        expected = info["world_size"] * (info["world_size"] + 1) / 2
        if not torch.all(tensor == expected):
            raise RuntimeError(f"all-reduce returned {tensor[0].item()} instead of {expected}")
        stage = "barrier"
        t0 = time.perf_counter()
        dist.barrier()
        t_barrier = time.perf_counter() - t0
        hosts: list[str] = [""] * info["world_size"]  # all_gather_object fills in every rank's host
        dist.all_gather_object(hosts, info["host"])
    except Exception as e:  # noqa: BLE001  every failure becomes one clear line
        print(failure(info, backend, stage, e), file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if info["rank"] == 0:
        bus_bw = 2 * (info["world_size"] - 1) / info["world_size"] * numel * 4 / max(t_reduce, 1e-9) / 1e9
        print(
            f"preflight OK: {info['world_size']} ranks on {len(set(hosts))} host(s) ({', '.join(sorted(set(hosts)))}), "
            f"backend {backend}, master {info['master_addr']}:{info['master_port']}: join {t_init:.2f}s, "
            f"all-reduce {numel * 4 / 1e6:.0f} MB {t_reduce * 1e3:.1f} ms ({bus_bw:.2f} GB/s bus), "
            f"barrier {t_barrier * 1e3:.1f} ms",
            flush=True,
        )
    return 0


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distsetup.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60, help="seconds before a rank gives up [60]")
    parser.add_argument("--size_mb", "--size-mb", type=float, default=16, help="all-reduce size in MB [16]")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args(argv)
    return run(args.timeout, args.size_mb)


if __name__ == "__main__":
    sys.exit(main())

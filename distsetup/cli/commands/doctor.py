"""`distsetup doctor`: versions, GPUs, SLURM, and whether the run config, its files and the world size agree."""

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import click

from distsetup import __version__
from distsetup.cli.options import NumberRange, option, positive
from distsetup.errors import DistsetupError
from distsetup.formats.batch import world_size_from
from distsetup.formats.default_paths import RUN_CONFIG
from distsetup.formats.fsdp import FsdpSpec
from distsetup.formats.reading import read_json
from distsetup.formats.settle import settle
from distsetup.formats.validate import validate_file

OK, WARN, FAIL = "ok", "warning", "problem"


@dataclass(frozen=True)
class Finding:
    level: str  # ok | warning | problem
    topic: str
    message: str


@click.command(
    "doctor",
    epilog="""\b
Examples:
  distsetup doctor
  distsetup doctor --config config.yaml --num_nodes 2 --num_gpus_per_node 8
  distsetup doctor --deepspeed_config config/ds_config.json --world_size 16
  distsetup doctor --preflight --nproc_per_node 2      # a timed all-reduce across 2 local ranks
""",
)
@option(
    "config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help=f"Run config to check [{RUN_CONFIG} where it exists].",
)
@option(
    "deepspeed_config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="DeepSpeed JSON to check; its backend is the run's, as with `launcher` [the run config's].",
)
@option(
    "fsdp_config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="FSDP JSON to check; its backend is the run's, as with `launcher` [the run config's].",
)
@option("world_size", type=positive, help="Planned data-parallel processes in total.")
@option("num_nodes", type=positive, help="Planned nodes.")
@option("num_gpus_per_node", type=positive, help="Planned processes per node.")
@option("preflight", is_flag=True, help="Run a timed all-reduce + barrier across --nproc_per_node local ranks.")
@option("nproc_per_node", type=positive, help="Ranks for --preflight [GPUs torch sees, else 2].")
@option("timeout", type=NumberRange(min=1), default=30, show_default=True, help="Preflight timeout (s).")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.pass_context
def doctor(
    ctx,
    config,
    deepspeed_config,
    fsdp_config,
    world_size,
    num_nodes,
    num_gpus_per_node,
    preflight,
    nproc_per_node,
    timeout,
    as_json,
):
    """Check the environment and that the run config, DeepSpeed/FSDP files and world size agree."""
    if deepspeed_config and fsdp_config:  # as the launcher refuses them
        raise DistsetupError(
            "--deepspeed_config and --fsdp_config name two backends (DeepSpeed and FSDP); a run trains with one.",
            "give the file of the backend you train with.",
        )
    world = world_size_from(world_size, num_nodes, num_gpus_per_node)
    if config is None and Path(RUN_CONFIG).is_file():  # as the launcher finds it
        config = Path(RUN_CONFIG)
    findings = environment_findings()
    findings += slurm_findings(os.environ, num_nodes, num_gpus_per_node)
    findings += consistency_findings(config, deepspeed_config, fsdp_config, world)
    if as_json:
        click.echo(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            mark = {OK: "  ok     ", WARN: "  WARNING", FAIL: "  PROBLEM"}[f.level]
            click.echo(f"{mark} {f.topic}: {f.message}")
    failed = any(f.level == FAIL for f in findings)
    if preflight:
        failed |= run_preflight(nproc_per_node, num_nodes, timeout) != 0
    if not as_json:
        problems = sum(f.level == FAIL for f in findings)
        click.echo(f"{problems} problem(s), {sum(f.level == WARN for f in findings)} warning(s).", err=problems > 0)
    ctx.exit(1 if failed else 0)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment_findings() -> list[Finding]:
    """Python, torch (CUDA, NCCL, GPUs it sees), deepspeed, NVML; deepspeed is not imported (slow)."""
    found = [
        Finding(OK, "python", f"{platform.python_version()} ({sys.executable})"),
        Finding(OK, "distsetup", __version__),
    ]
    try:
        import torch
    except ImportError:
        found.append(Finding(WARN, "torch", "not installed: training needs it (pip install 'distsetup[train]')."))
    else:
        cuda = torch.version.cuda or "none (CPU build)"
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a"
        found.append(
            Finding(
                OK,
                "torch",
                f"{torch.__version__}, CUDA {cuda}, NCCL {nccl}, "
                f"gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}",
            )
        )
        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            found.append(Finding(OK, "gpus (torch)", f"{len(names)}: {', '.join(names)}" + _visible_devices_note()))
        else:
            found.append(
                Finding(
                    OK,
                    "gpus (torch)",
                    "no GPU visible to torch: training runs on CPU with gloo." + _visible_devices_note(),
                )
            )
    ds = _version("deepspeed")
    found.append(Finding(OK if ds else WARN, "deepspeed", ds or "not installed (needed for backend deepspeed)."))
    for dist in ("transformers", "nvidia-ml-py"):
        version = _version(dist)
        if version:
            found.append(Finding(OK, dist, version))
    from distsetup.planning.gpus import NoGpuError, query_gpus

    try:
        gpus = query_gpus()
        found.append(
            Finding(
                OK,
                "gpus (nvml)",
                ", ".join(
                    f"{g.index}: {g.name} {g.memory_free / 2**30:.0f}/{g.memory_total / 2**30:.0f} GiB free"
                    for g in gpus
                ),
            )
        )
    except NoGpuError as e:
        found.append(Finding(OK, "gpus (nvml)", e.problem))
    except DistsetupError as e:
        found.append(Finding(WARN, "gpus (nvml)", e.message))
    return found


def _visible_devices_note() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={value})" if value is not None else ""


def slurm_nodes(env) -> list[str]:
    """The allocation's hostnames in order (scontrol expands the compressed list)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return []
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()
    return [nodelist]


def slurm_findings(env, num_nodes: int | None, gpus_per_node: int | None) -> list[Finding]:
    """In a SLURM allocation: its nodes, the master address and ranks the launcher will use, vs the plan."""
    if "SLURM_JOB_ID" not in env:
        return [Finding(OK, "slurm", "not inside a SLURM allocation.")]
    nodes = slurm_nodes(env)
    nnodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or len(nodes) or 1)
    gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE")
    found = [
        Finding(
            OK,
            "slurm",
            f"job {env['SLURM_JOB_ID']}: {nnodes} node(s) {', '.join(nodes)}; master address "
            f"{nodes[0] if nodes else '?'}; GPUs per node {gpus or 'not requested'}; the launcher "
            f"runs torchrun --nnodes {nnodes} on each node.",
        )
    ]
    if num_nodes and num_nodes != nnodes:
        found.append(
            Finding(
                FAIL,
                "slurm",
                f"the plan says {num_nodes} nodes but the allocation has {nnodes}.",
            )
        )
    if gpus_per_node and gpus and gpus.split(":")[-1].isdigit() and int(gpus.split(":")[-1]) < gpus_per_node:
        found.append(
            Finding(FAIL, "slurm", f"the plan says {gpus_per_node} GPUs per node but the allocation gives {gpus}.")
        )
    return found


def consistency_findings(
    config: Path | None, ds_path: Path | None, fsdp_path: Path | None, world: int | None
) -> list[Finding]:
    """Every file through `distsetup validate`'s rules for this world size, then the rules across files."""
    found = []
    cfg = None
    if config:
        flags = _backend_flags(ds_path, fsdp_path)
        problems = _file_findings(config, "run_config", world, flags)
        found += problems
        if not problems:
            from distsetup.formats.runconfig_load import load_run_config

            cfg = load_run_config(config, flags)
            dist = cfg.resolved(config.parent).distributed
            ds_path = ds_path or (Path(dist.deepspeed_config) if dist.deepspeed_config else None)
            fsdp_path = fsdp_path or (Path(dist.fsdp_config) if dist.fsdp_config else None)
    for path, kind in ((ds_path, "deepspeed"), (fsdp_path, "fsdp")):
        if path and not (config and cfg and _referenced(cfg, kind, path, config.parent)):
            found += _file_findings(path, kind, world)
    if cfg is not None:
        try:
            ds = read_json(ds_path) if ds_path else None
            fsdp = read_json(fsdp_path) if fsdp_path else None
            found += [Finding(level, "consistency", msg) for level, msg in cross_file_rules(cfg, ds, fsdp, world)]
        except DistsetupError:
            pass  # a file that cannot be read is a finding above already
    if not any(f.level == FAIL for f in found) and (config or ds_path or fsdp_path):
        files = [str(p) for p in (config, ds_path, fsdp_path) if p]
        found.append(
            Finding(
                OK,
                "configs",
                (f"{', '.join(files)} agree" if len(files) > 1 else f"{files[0]} is consistent")
                + (
                    f" for world size {world}."
                    if world
                    else " (give --num_nodes/--num_gpus_per_node to check the batch identity)."
                ),
            )
        )
    return found


def _backend_flags(ds_path: Path | None, fsdp_path: Path | None) -> list[str]:
    """The run config's overrides that a file given here makes, as the launcher's --deepspeed_config or
    --fsdp_config does: its backend is the run's, and the file the one it reads."""
    from distsetup.formats.runconfig_load import backend_chosen_by

    kind, path = ("deepspeed", ds_path) if ds_path else ("fsdp", fsdp_path)
    if path is None:
        return []
    # as JSON, which YAML reads as it is: a path stays a string, a boolean a boolean
    settings = backend_chosen_by(kind, str(path.resolve()))
    return [f"distributed.{key}={json.dumps(value)}" for key, value in settings.items()]


def _file_findings(path: Path, kind: str, world: int | None, overrides: Sequence[str] = ()) -> list[Finding]:
    """`distsetup validate`'s problems with one file, as findings; a file it cannot read is one finding."""
    try:
        problems = validate_file(path, kind, world, overrides=overrides).problems
    except DistsetupError as e:
        return [Finding(FAIL, str(path), e.message)]
    return [Finding(FAIL, str(path), str(p)) for p in problems]


def _referenced(cfg, kind: str, path: Path, base: Path) -> bool:
    """Whether validate_file(config) already checked `path` as the config's own DeepSpeed/FSDP file."""
    from distsetup.formats.runconfig import resolve_config_path

    value = getattr(cfg.distributed, f"{kind}_config")
    return bool(value) and resolve_config_path(value, base).resolve() == path.resolve()


def cross_file_rules(cfg, ds: dict | None, fsdp: dict | None, world: int | None) -> list[tuple[str, str]]:
    """What the run config says against what its DeepSpeed/FSDP file says: (level, message) pairs."""
    out = []
    backend, t = cfg.distributed.backend, cfg.training
    # a file the run config names beside another backend: the trainer leaves it unread, said in its note
    if ds is not None and backend != "deepspeed":
        out.append(
            (WARN, f"the DeepSpeed file is left unread: backend is {backend} (set backend: deepspeed to use it).")
        )
    if fsdp is not None and backend != "fsdp":
        out.append((WARN, f"the FSDP file is left unread: backend is {backend} (set backend: fsdp to use it)."))
    fsdp_settings = cfg.distributed.fsdp or fsdp
    settled = settle(
        cfg,
        ds if backend == "deepspeed" else None,
        FsdpSpec.from_dict(fsdp_settings) if fsdp_settings and backend == "fsdp" else None,
        world,
    )
    out += [(FAIL, str(p)) for p in settled.problems]
    out += [(WARN, note) for note in settled.notes]
    if settled.train_batch is not None and not settled.problems:
        scaled = (
            f" (training.lr {t.lr:g} scaled {t.scale_lr} from batch {t.base_batch_size})" if settled.lr_scaled else ""
        )
        out.append(
            (
                OK,
                f"global batch {settled.train_batch} = micro {settled.micro_batch} x accumulation "
                f"{settled.accumulation} x world size {world}; {settled.precision}; grad clip "
                f"{settled.grad_clip:g}; lr {settled.lr:.6g}{scaled}.",
            )
        )
    return out


def preflight_command(nproc_per_node: int, timeout: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc_per_node}",
        "-m",
        "distsetup.preflight",
        "--timeout",
        f"{timeout:g}",
    ]


def run_preflight(nproc_per_node: int | None, num_nodes: int | None, timeout: float) -> int:
    """Local ranks: run the preflight under torchrun now. Several nodes: say what to run on each."""
    if num_nodes and num_nodes > 1:
        click.echo(
            "  preflight: across nodes it must run under the launcher on every node: "
            "`distsetup launcher --preflight ...` / `distsetup slurm --preflight ...`, or on each node: "
            "torchrun --nnodes N --node_rank R --master_addr FIRST_NODE --master_port PORT "
            f"--nproc_per_node G -m distsetup.preflight --timeout {timeout:g}"
        )
        return 0
    try:
        import torch
    except ImportError:
        raise DistsetupError("--preflight needs torch.", "pip install 'distsetup[train]'.")
    nproc = nproc_per_node or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    command = preflight_command(nproc, timeout)
    click.echo(f"  preflight: {shlex.join(command)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout * 3 + 30, env=env)
    except subprocess.TimeoutExpired:
        click.echo(f"  PROBLEM preflight: no answer within {timeout * 3 + 30:g}s.", err=True)
        return 1
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("preflight")]
    for line in lines or (done.stdout + done.stderr).strip().splitlines()[-5:]:
        click.echo(f"  {line}", err=done.returncode != 0)
    return done.returncode

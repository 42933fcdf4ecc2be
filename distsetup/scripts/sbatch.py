"""The SLURM batch script as plain data: validated #SBATCH directives (a sorted mapping) and set-up lines.

`build_slurm_script` renders templates/slurm_job.sh.j2: `srun` starts one launcher per node, every
per-node value ($SLURM_NODEID, the hostfile) expands on its node, and all nodes form one world.
Nothing here touches Click, the environment or the disk.
"""

import re
from dataclasses import dataclass

from distsetup.errors import DistsetupError
from distsetup.formats.default_paths import SCRIPTS
from distsetup.scripts.launch_plan import LaunchSpec, check_launch, launch_context, literal_dollars
from distsetup.scripts.shell_words import check_text
from distsetup.scripts.templating import render

GPU_REQUESTS = ("gres", "gpus-per-node", "none")
MAIL_TYPES = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_MEMORY = re.compile(r"^[0-9]+[KMGT]?$", re.IGNORECASE)
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")
_MODULE = re.compile(r"^[A-Za-z0-9_.+/-]+$")
_TIME_FORMATS = (  # the forms `sbatch --time` accepts
    (re.compile(r"^(\d+)$"), ("minutes",)),
    (re.compile(r"^(\d+):(\d+)$"), ("minutes", "seconds")),
    (re.compile(r"^(\d+):(\d+):(\d+)$"), ("hours", "minutes", "seconds")),
    (re.compile(r"^(\d+)-(\d+)$"), ("days", "hours")),
    (re.compile(r"^(\d+)-(\d+):(\d+)$"), ("days", "hours", "minutes")),
    (re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$"), ("days", "hours", "minutes", "seconds")),
)
_UNIT_SECONDS = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
_NO_LIMIT = ("UNLIMITED", "INFINITE")  # sbatch reads either, in any case, as no time limit
_TASKS = "one task per node runs the launcher: set the processes with --num_gpus_per_node"
# #SBATCH keys distsetup writes itself (or that would break one launcher per node) -> what to do instead.
MANAGED_SBATCH_KEYS = {
    **{
        key: f"use --{key.replace('-', '_')}"
        for key in (
            "partition",
            "account",
            "qos",
            "constraint",
            "exclusive",
            "cpus-per-task",
            "mem",
            "mem-per-gpu",
            "mail-user",
            "mail-type",
            "requeue",
            "job-name",
        )
    },
    **dict.fromkeys(("ntasks-per-node", "ntasks", "tasks-per-node", "ntasks-per-gpu", "gpus-per-task"), _TASKS),
    "nodes": "use --num_nodes",
    "time": "use --time_limit",
    "output": "use --log_output",
    "error": "use --log_error",
    "gres": "use --num_gpus_per_node (and --gpu_type)",
    "gpus-per-node": "use --num_gpus_per_node with --gpu_request gpus-per-node",
    "gpus": "use --num_gpus_per_node",
    "signal": "use --requeue --signal_seconds N",
    "no-requeue": "drop --requeue (the default)",
}
SHUTDOWN_MARGIN_SECONDS = 30  # of the warning time, left for `scontrol requeue` and the launcher's exit


@dataclass(frozen=True)
class SlurmSpec:
    """One batch job: the #SBATCH resources, the set-up lines, and the launch (one world over all nodes)."""

    launch: LaunchSpec
    job_name: str = "distsetup"
    gpu_request: str = "gres"  # --gres=gpu:N, --gpus-per-node=N, or no GPU line
    gpu_type: str | None = None  # e.g. a100 -> --gres=gpu:a100:N
    cpus_per_task: int | None = None
    mem: str | None = None
    mem_per_gpu: str | None = None
    time_limit: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    log_output: str = "%x-%j.out"
    log_error: str | None = None
    mail_user: str | None = None
    mail_type: str | None = None
    extra_sbatch: tuple[tuple[str, str | None], ...] = ()
    modules: tuple[str, ...] = ()  # environment modules (`module load`)
    conda_env: str | None = None
    venv: str | None = None
    requeue: bool = False
    signal_seconds: int = 120


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a SLURM time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None: UNLIMITED, or 0,
    which sbatch reads as no limit. As sbatch, a field past its range counts on (25:61:00 is 1-02:01:00)."""
    if text.strip().upper() in _NO_LIMIT:
        return None
    for pattern, units in _TIME_FORMATS:
        match = pattern.match(text.strip())
        if match:
            values = dict(zip(units, map(int, match.groups()), strict=True))
            return sum(_UNIT_SECONDS[u] * v for u, v in values.items()) or None
    raise DistsetupError(
        f"time limit '{text}' is not one SLURM accepts.",
        "write minutes (90), MM:SS, HH:MM:SS (48:00:00), D-HH, D-HH:MM, D-HH:MM:SS (2-00:00:00) or UNLIMITED.",
    )


def parse_sbatch_pairs(items) -> tuple[tuple[str, str | None], ...]:
    """--sbatch KEY=VALUE (or a bare KEY for a flag) -> pairs, keys as sbatch spells them."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not _SBATCH_KEY.match(key):
            raise DistsetupError(
                f"--sbatch '{item}' is not KEY=VALUE with an sbatch option name as KEY.",
                "write e.g. --sbatch reservation=big or --sbatch nice=10.",
            )
        pairs.append((key, value if sep else None))
    return tuple(pairs)


def shutdown_grace_seconds(signal_seconds: int) -> int:
    """How long the launcher lets the training processes checkpoint after SIGTERM before SIGKILL: SLURM's
    warning time (--signal_seconds) less a margin for the requeue (half the warning when it is short)."""
    return max(signal_seconds - SHUTDOWN_MARGIN_SECONDS, signal_seconds // 2)


def check_slurm(spec: SlurmSpec) -> None:
    """Every rule across the SLURM options; raises DistsetupError naming the fix."""
    check_launch(spec.launch)
    if spec.launch.nproc_per_node is None:
        raise DistsetupError("distsetup slurm needs a number for --num_gpus_per_node.", "e.g. --num_gpus_per_node 8.")
    if spec.gpu_request not in GPU_REQUESTS:
        raise DistsetupError(f"unknown GPU request {spec.gpu_request}.", f"use one of {', '.join(GPU_REQUESTS)}.")
    if spec.time_limit is not None:
        limit = time_limit_seconds(spec.time_limit)
        if spec.requeue and limit is not None and spec.signal_seconds >= limit:
            raise DistsetupError(  # init writes the default warning: it has no --signal_seconds
                f"the time limit {spec.time_limit} ({limit} s) is not longer than the preemption warning, "
                f"{spec.signal_seconds} s before it (--signal_seconds): the job would be warned as it starts, and "
                "requeued again and again.",
                f"give a longer --time_limit, or (distsetup slurm) --signal_seconds under {limit}.",
            )
    check_partition(spec.partition)
    check_account(spec.account)
    for name in ("mem", "mem_per_gpu"):
        value = getattr(spec, name)
        # 0 is SLURM's "all the node's memory"; under a GB, a number without a unit was meant as gigabytes
        if value is not None and value.isascii() and value.isdigit() and 0 < int(value) < 1024:
            raise DistsetupError(
                f"--{name} {value}: SLURM reads a number without a unit as megabytes ({value} MB for a training job).",
                f"write the unit: {value}G for gigabytes, or {value}M for megabytes.",
            )
        if value is not None and not _MEMORY.match(value):
            raise DistsetupError(f"--{name} '{value}' is not a SLURM memory size.", "write e.g. 64G or 512000M.")
    if spec.mem and spec.mem_per_gpu:
        raise DistsetupError("--mem and --mem_per_gpu are mutually exclusive in SLURM.", "give one of them.")
    if spec.mail_type is not None and not all(t in MAIL_TYPES for t in spec.mail_type.split(",")):
        raise DistsetupError(
            f"--mail_type {spec.mail_type} is not a SLURM mail type.", f"use one or more of {', '.join(MAIL_TYPES)}."
        )
    if spec.conda_env and spec.venv:
        raise DistsetupError("--conda_env and --venv are mutually exclusive.", "activate one environment.")
    for module in spec.modules:
        if not _MODULE.match(module):
            raise DistsetupError(f"--env_module {module!r} is not an environment-module name.", "write e.g. cuda/12.4.")
    if spec.gpu_type is not None and not _NAME.match(spec.gpu_type):
        raise DistsetupError(f"--gpu_type '{spec.gpu_type}' is not a GRES type.", "write e.g. a100.")
    for name in (
        "job_name",
        "account",
        "qos",
        "constraint",
        "log_output",
        "log_error",
        "mail_user",
        "conda_env",
        "venv",
    ):
        check_text(f"--{name}", getattr(spec, name))
    for key, value in spec.extra_sbatch:
        check_text(f"--sbatch {key}", value)
        managed = MANAGED_SBATCH_KEYS.get(key) or ("use --requeue" if key == "open-mode" and spec.requeue else None)
        if managed:
            raise DistsetupError(f"--sbatch {key}: distsetup writes #SBATCH --{key} itself.", f"{managed}.")


def slurm_warnings(spec: SlurmSpec) -> list[str]:
    """Things that are allowed but probably not meant."""
    warnings = []
    if spec.cpus_per_task is None and not spec.exclusive:
        nproc = spec.launch.nproc_per_node or 1
        warnings.append(
            f"no --cpus_per_task: SLURM may give each node's single task 1 CPU, shared by all "
            f"{nproc} process(es) and their data loaders; add e.g. --cpus_per_task {8 * nproc} "
            "(8 per GPU), or --exclusive for whole nodes."
        )
    return warnings


def sbatch_quote(value: str) -> str:
    """A value as sbatch reads it from a #SBATCH line: plain, or in double quotes with \\ escapes."""
    if _SAFE_VALUE.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_directives(spec: SlurmSpec) -> dict[str, str | None]:
    """The #SBATCH options as a mapping sorted by name; None marks a flag. --sbatch pairs win."""
    nproc = spec.launch.nproc_per_node
    entries = {
        "job-name": spec.job_name,
        "nodes": str(spec.launch.num_nodes),
        "ntasks-per-node": "1",
        "cpus-per-task": spec.cpus_per_task,
        "mem": spec.mem,
        "mem-per-gpu": spec.mem_per_gpu,
        "time": spec.time_limit,
        "partition": spec.partition,
        "account": spec.account,
        "qos": spec.qos,
        "constraint": spec.constraint,
        "output": spec.log_output,
        "error": spec.log_error,
        "mail-user": spec.mail_user,
        "mail-type": spec.mail_type,
    }
    if spec.gpu_request == "gres":
        entries["gres"] = f"gpu:{spec.gpu_type}:{nproc}" if spec.gpu_type else f"gpu:{nproc}"
    elif spec.gpu_request == "gpus-per-node":
        entries["gpus-per-node"] = f"{spec.gpu_type}:{nproc}" if spec.gpu_type else str(nproc)
    directives: dict[str, str | None] = {key: str(value) for key, value in entries.items() if value is not None}
    if spec.exclusive:
        directives["exclusive"] = None
    if spec.requeue:
        directives["requeue"] = None
        directives["open-mode"] = "append"  # keep the first run's log when the job is requeued
        directives["signal"] = f"B:USR1@{spec.signal_seconds}"
    directives.update(spec.extra_sbatch)
    return dict(sorted(directives.items()))


def check_partition(partition: str | None) -> None:
    if partition is not None and not _PARTITION.match(partition):
        raise DistsetupError(
            f"partition {partition!r} is not a SLURM partition name.",
            "use letters, digits, _ . - (several: gpu,gpu-long).",
        )


def check_account(account: str | None) -> None:
    """An account is one name (sbatch refuses `--account="my account"` when the job is submitted)."""
    if account is not None and not _NAME.match(account):
        raise DistsetupError(f"--account {account!r} is not a SLURM account name.", "use letters, digits, _ . -")


def sbatch_lines(directives: dict[str, str | None]) -> list[str]:
    return [
        f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={sbatch_quote(value)}"
        for key, value in directives.items()
    ]


def build_slurm_script(spec: SlurmSpec, command_line: str, output: str = SCRIPTS["slurm"]) -> str:
    """scripts/slurm_job.sh (`command_line`, how to regenerate it, and `output` go in its header)."""
    check_slurm(spec)
    context = launch_context(spec.launch, under_slurm=True)
    context["literal_dollars"] = literal_dollars([context, spec.modules, spec.venv, spec.conda_env])
    return render(
        "slurm_job.sh.j2",
        command_line=command_line,
        output_name=output if output not in (None, "-") else SCRIPTS["slurm"],
        sbatch_lines=sbatch_lines(sbatch_directives(spec)),
        modules=list(spec.modules),
        conda_env=spec.conda_env,
        venv=spec.venv,
        requeue=spec.requeue,
        signal_seconds=spec.signal_seconds,
        shutdown_timeout=shutdown_grace_seconds(spec.signal_seconds),
        fixed_port=spec.launch.master_port,
        per_node_unit="CPU process(es)" if spec.gpu_request == "none" else "GPU(s)",
        **context,
    )

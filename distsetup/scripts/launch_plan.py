"""The launch command line as plain data: what runs, on how many nodes and processes, with which launcher.

`LaunchSpec` is the validated, frozen description shared by `distsetup launcher` (one script per node)
and `distsetup slurm` (srun starts one launcher per node). `launch_context` turns it into the plain
values the templates in templates/ render; `build_launcher_script` renders scripts/run_training.sh.
Nothing here touches Click, the environment or the disk.

What runs is distsetup's own trainer (`python -m distsetup.train`, inside the package, so a wheel install
has it) unless a spec names a user's script or module. Paths stay as the user wrote them, relative to
`workdir` (the folder `distsetup` ran in): the scripts `cd` there first, so they run the same from any
folder, and the run config's own relative paths (output_dir, data) keep their meaning too.
"""

import ipaddress
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats.batch import check_world_counts
from distsetup.formats.default_paths import SCRIPTS
from distsetup.formats.runconfig import BACKENDS
from distsetup.scripts.environment import EnvSpec, environment_lines
from distsetup.scripts.shell_words import check_text
from distsetup.scripts.templating import render

LAUNCH_METHODS = ("torchrun", "deepspeed", "accelerate")
RDZV_BACKENDS = ("static", "c10d")
DEFAULT_TRAINER = "distsetup.train"  # python -m distsetup.train: the trainer that ships in the package
DEFAULT_MASTER_PORT = 29500
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class LaunchSpec:
    """One world: num_nodes x nproc_per_node processes running the trainer (or a user's `script` or
    `module`) with `train_args`, from `workdir`."""

    backend: str = "ddp"
    launch_method: str = "torchrun"
    script: str | None = None  # a user's training program (python FILE)
    module: str | None = None  # a user's training module (python -m); neither: DEFAULT_TRAINER
    workdir: str | None = None  # absolute folder the script cds to; None: where it is started
    config: str | None = None
    deepspeed_config: str | None = None
    fsdp_config: str | None = None
    num_nodes: int = 1
    nproc_per_node: int | None = None  # None: every visible GPU ("auto")
    node_rank: int | None = None  # None: NODE_RANK from the environment at run time
    master_addr: str | None = None  # None: 127.0.0.1 on one node; MASTER_ADDR at run time on several
    master_port: int | None = None  # None: 29500, a free port on a single node, under SLURM from the job id
    rdzv_backend: str = "static"
    rdzv_id: str = "distsetup"
    hosts: tuple[str, ...] = ()  # deepspeed launcher multi-node: hostfile names
    ssh: bool = False  # deepspeed launcher: pdsh over ssh from node 0
    gpus: tuple[int, ...] | None = None  # CUDA_VISIBLE_DEVICES
    env: EnvSpec = field(default_factory=EnvSpec)
    preflight: bool = False
    accelerate_fsdp_args: tuple[str, ...] = ()  # the FSDP file as `accelerate launch` flags
    accelerate_hybrid_shard: bool = False  # an FSDP2 file's HYBRID_*: Accelerate's 2-D mesh, nodes x processes
    fsdp1_strategy: str | None = None  # an FSDP1 file's, for the HF Trainer's Accelerate (FSDP_SHARDING_STRATEGY)
    # the backend and its file are the run config's own (no flag chose them): distsetup's trainer reads them from it
    # when it starts, so that an edit of the run config takes effect without a new script
    backend_from_run_config: bool = False

    @property
    def world_size(self) -> int | None:
        return None if self.nproc_per_node is None else self.num_nodes * self.nproc_per_node

    @property
    def runs_default_trainer(self) -> bool:
        """Whether the target is distsetup's trainer, which takes section.key=value overrides and hands a
        DeepSpeed file to DeepSpeed as is (so "auto" values are refused for it). `--script src/train.py`, the
        trainer's old path (a thin file that runs it), still counts."""
        if self.script is not None:
            return Path(self.script).parts[-2:] == ("src", "train.py")
        return self.module in (None, DEFAULT_TRAINER)

    @property
    def target(self) -> str:
        """The module or script that runs."""
        return self.script if self.script is not None else self.module or DEFAULT_TRAINER


def check_launch(spec: LaunchSpec) -> None:
    """Every rule that spans options; raises DistsetupError naming the fix."""
    _check_inputs(spec)
    _check_world(spec)
    _check_launcher(spec)


def _check_inputs(spec: LaunchSpec) -> None:
    """Names and paths without control characters, the values the builder knows, one target at most."""
    for name, flag in (
        ("script", "--script"),
        ("module", "--python_module"),
        ("config", "--config"),
        ("deepspeed_config", "--deepspeed_config"),
        ("fsdp_config", "--fsdp_config"),
        ("master_addr", "--master_addr"),
        ("rdzv_id", "--rdzv_id"),
        ("workdir", "the working folder"),
    ):
        check_text(flag, getattr(spec, name))
    if spec.workdir is not None and not Path(spec.workdir).is_absolute():
        raise DistsetupError(
            f"working folder {spec.workdir!r} is not an absolute path.", "this is a distsetup bug; please report it."
        )
    for name, value in spec.env.extra:
        check_text(f"--env {name}", value)
    # Click's choices make these unreachable from the CLI; the pure builder still needs them (an unknown
    # launch method would otherwise render the accelerate branch).
    for name, value, choices in (
        ("backend", spec.backend, BACKENDS),
        ("launch method", spec.launch_method, LAUNCH_METHODS),
        ("rendezvous backend", spec.rdzv_backend, RDZV_BACKENDS),
    ):
        if value not in choices:
            raise DistsetupError(f"unknown {name} {value}.", f"use one of {', '.join(choices)}.")
    if spec.script is not None and spec.module is not None:
        raise DistsetupError(
            "--script and --python_module are mutually exclusive.",
            f"give one of them, or neither for distsetup's trainer (python -m {DEFAULT_TRAINER}).",
        )


def _check_world(spec: LaunchSpec) -> None:
    """Node and process counts, this node's rank among them, the GPUs listed for them, the master's port."""
    check_world_counts(spec.num_nodes, spec.nproc_per_node)
    if spec.node_rank is not None and not 0 <= spec.node_rank < spec.num_nodes:
        raise DistsetupError(
            f"--node_rank {spec.node_rank} is out of range for --num_nodes {spec.num_nodes}.",
            f"node ranks run from 0 to {spec.num_nodes - 1}.",
        )
    if spec.gpus is not None and spec.nproc_per_node is not None and len(spec.gpus) != spec.nproc_per_node:
        raise DistsetupError(
            f"--gpus lists {len(spec.gpus)} GPU(s) but --num_gpus_per_node is {spec.nproc_per_node}.",
            "drop --num_gpus_per_node (it follows --gpus) or make them agree.",
        )
    if spec.master_port is not None and not 1 <= spec.master_port <= 65535:
        raise DistsetupError(f"--master_port {spec.master_port} is not a TCP port.", "use e.g. 29500.")


def _check_launcher(spec: LaunchSpec) -> None:
    """What the backend and the launcher need: a DeepSpeed file, a rendezvous it supports, hosts, ssh."""
    if spec.backend == "deepspeed" and not spec.deepspeed_config:
        raise DistsetupError(
            "backend deepspeed needs a DeepSpeed config file.",
            "add --deepspeed_config FILE (write one with `distsetup deepspeed`).",
        )
    if spec.rdzv_backend == "c10d" and spec.launch_method != "torchrun":
        raise DistsetupError(
            f"--rdzv_backend c10d works with torchrun, not {spec.launch_method}.",
            "drop --rdzv_backend or use --launch_method torchrun.",
        )
    if spec.rdzv_backend == "c10d" and spec.node_rank is not None and spec.num_nodes > 1:
        raise DistsetupError(
            "--node_rank is not used with --rdzv_backend c10d: ranks are assigned as nodes join.",
            "drop --node_rank (or use --rdzv_backend static).",
        )
    if spec.gpus is not None and spec.launch_method == "deepspeed" and spec.num_nodes > 1:
        raise DistsetupError(
            "--gpus does not work with the deepspeed launcher on several nodes: its hostfile "
            "resets CUDA_VISIBLE_DEVICES to 0..N-1, so it would train on other GPUs.",
            "use --launch_method torchrun (the default), or drop --gpus.",
        )
    if spec.master_addr is not None and not is_host(spec.master_addr):
        raise DistsetupError(
            f"--master_addr {spec.master_addr!r} is not a host name or an IP address.",
            "give node 0's name or address, e.g. --master_addr gpu01.",
        )
    if spec.module is not None and not all(part.isidentifier() for part in spec.module.split(".")):
        raise DistsetupError(
            f"--python_module {spec.module!r} is not a module name (python -m takes names such as mypkg.train).",
            "give the module's dotted name; a file goes to --script.",
        )
    for host in spec.hosts:
        if not _HOST.match(host):
            raise DistsetupError(
                f"host name '{host}' is not a valid host name.", "list hosts as e.g. --hosts gpu01,gpu02."
            )
    if spec.hosts and spec.launch_method != "deepspeed":  # torchrun and accelerate start on each node by themselves
        raise DistsetupError(
            f"--hosts names the deepspeed launcher's hostfile; {spec.launch_method} reads none, and would ignore it.",
            "run the script on each node (its node rank from --node_rank or the scheduler), or add "
            "--launch_method deepspeed.",
        )
    if spec.hosts and len(spec.hosts) != spec.num_nodes:
        raise DistsetupError(
            f"--hosts lists {len(spec.hosts)} host(s) for --num_nodes {spec.num_nodes}.", "list one host per node."
        )
    if len(set(spec.hosts)) != len(spec.hosts):  # DeepSpeed's hostfile reader refuses a host named twice
        twice = next(host for host in spec.hosts if spec.hosts.count(host) > 1)
        raise DistsetupError(f"--hosts names {twice} twice.", "list each node once.")
    if spec.ssh and spec.launch_method != "deepspeed":
        raise DistsetupError("--ssh is for the deepspeed launcher.", "add --launch_method deepspeed or drop --ssh.")
    if spec.ssh and (spec.num_nodes < 2 or not spec.hosts):
        raise DistsetupError(
            "--ssh (pdsh) needs several nodes and their names.", "add --num_nodes N --hosts host1,host2,..."
        )


def is_host(text: str) -> bool:
    """A host name, or an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return _HOST.match(text) is not None
    return True


def launch_warnings(spec: LaunchSpec, run_command: str) -> list[str]:
    """Things that are allowed but probably not meant; `run_command` starts the script (bash X, sbatch X)."""
    warnings = []
    if spec.backend == "fsdp" and spec.launch_method == "accelerate" and not spec.fsdp_config:
        if not spec.runs_default_trainer:  # distsetup's trainer shards each block without a file
            warnings.append(
                "--use_fsdp without --fsdp_config: your program's FSDP takes the settings of accelerate's default "
                "config (`accelerate config`), else accelerate launch's own (FSDP1, the whole model one unit); "
                "`distsetup fsdp --transformer_layer_cls_to_wrap YourBlock -o fsdp.json` writes a file to add."
            )
    if spec.launch_method == "deepspeed" and spec.num_nodes > 1 and not spec.ssh and not spec.hosts:
        warnings.append(
            "the hostfile names the nodes node0, node1, ...; with --no_ssh they are labels only "
            "(give --hosts for real names)."
        )
    return warnings


def train_args(spec: LaunchSpec) -> list[str]:
    """Arguments after the script: the run config, the backend and its config file (for distsetup's trainer only
    where a flag chose them: the run config's own are read from it when the run starts).

    `section.key=value` overrides are the trainer's syntax, so they go only to distsetup's trainer, which
    reads their values as YAML: a path goes JSON-quoted (`@x.json`, `yes` or `a: b.json` stay strings). Any
    script gets `--deepspeed FILE`, the spelling of distsetup's trainer and of the HF Trainer; a script of the user's
    `--fsdp --fsdp_config FILE`, the HF Trainer's. Under accelerate a program of the user's gets neither: the file
    goes to accelerate launch, whose Accelerator (the HF Trainer's too) reads it, and a plain Accelerate program
    would refuse the arguments.
    """
    args = ["--config", spec.config] if spec.config else []
    left_to_the_run_config = spec.runs_default_trainer and spec.backend_from_run_config
    if spec.runs_default_trainer:
        if not left_to_the_run_config:
            args.append(f"distributed.backend={spec.backend}")
            if spec.backend == "fsdp" and spec.fsdp_config:
                args.append(f"distributed.fsdp_config={json.dumps(spec.fsdp_config, ensure_ascii=False)}")
        if spec.env.timeout_minutes is not None:
            args.append(f"distributed.timeout_minutes={spec.env.timeout_minutes}")
    accelerate_reads_it = spec.launch_method == "accelerate" and not spec.runs_default_trainer
    if spec.backend == "deepspeed" and spec.deepspeed_config and not accelerate_reads_it and not left_to_the_run_config:
        args += ["--deepspeed", spec.deepspeed_config]
    if spec.backend == "fsdp" and not spec.runs_default_trainer and not accelerate_reads_it:
        args += ["--fsdp", *(["--fsdp_config", spec.fsdp_config] if spec.fsdp_config else [])]  # the HF Trainer's
    return args


def launch_context(spec: LaunchSpec, under_slurm: bool = False) -> dict:
    """Plain values for templates/_launch.sh.j2 and the scripts' headers. `under_slurm`: the srun program of
    slurm_job.sh, which SLURM starts on every node (its node rank from SLURM, its port from the job) and signals
    every process of."""
    world = spec.world_size
    nproc = "auto" if spec.nproc_per_node is None else spec.nproc_per_node
    single = spec.num_nodes == 1
    one_node_here = single and not under_slurm  # a launch that needs no other node's address or port
    deepspeed_here = spec.launch_method == "deepspeed" and not spec.ssh
    return {
        "backend": spec.backend,
        "launch_method": spec.launch_method,
        "target": spec.target,
        "is_module": spec.script is None,
        # distsetup's trainer checks the run config and its arguments once before the launch (--check), and reads no
        # accelerate setting; a user's program owns its arguments, and its Accelerator (if any) reads accelerate's
        "default_trainer": spec.runs_default_trainer,
        "workdir": spec.workdir,
        "workdir_why": "where distsetup ran: relative paths here and in the run config start there",
        "workdir_missing": "(where this script was written): regenerate it in the project folder or edit WORKDIR",
        "train_args": train_args(spec),
        "num_nodes": spec.num_nodes,
        "nproc_per_node": nproc,
        "world_desc": f"{world} process(es)" if world else f"{spec.num_nodes} x (visible GPUs) processes",
        "node_rank": None if under_slurm else 0 if single and spec.node_rank is None else spec.node_rank,
        "master_addr": "127.0.0.1" if single and spec.master_addr is None else spec.master_addr,
        "master_addr_sh": _always_quoted("127.0.0.1" if single and spec.master_addr is None else spec.master_addr),
        "master_port": spec.master_port or DEFAULT_MASTER_PORT,
        "standalone": one_node_here and spec.master_port is None and spec.launch_method == "torchrun",
        # the other launchers on one node: a free port, chosen when the script starts
        "free_port": one_node_here and spec.master_port is None and spec.launch_method != "torchrun",
        # the deepspeed launcher (templates/_launch.sh.j2): SIGTERM to this script reaches its launch.py; under SLURM,
        # which signals every process, the task outlives the launcher's runner.py until launch.py and the ranks end
        "hands_sigterm_to_launch_py": deepspeed_here and not under_slurm,
        "outlives_deepspeed_runner": deepspeed_here and under_slurm,
        # under SLURM the node's program hands a USR1 on to torchrun or accelerate as the SIGTERM they forward
        "hands_usr1_on_as_sigterm": under_slurm and spec.launch_method != "deepspeed",
        # the node's program ends through end_node_program (templates/_usr1_on_node.sh.j2)
        "under_slurm": under_slurm,
        "single_node": one_node_here,
        "rdzv_backend": spec.rdzv_backend,
        "rdzv_id": spec.rdzv_id,
        "deepspeed_config": spec.deepspeed_config,
        "accelerate_fsdp_args": "\n".join(spec.accelerate_fsdp_args),
        "accelerate_hybrid_shard": spec.accelerate_hybrid_shard,
        "fsdp1_strategy": spec.fsdp1_strategy,
        # the deepspeed launcher's hostfile over several nodes (slots at run time); no other launch lists nodes
        "hosts": list(spec.hosts or (f"node{i}" for i in range(spec.num_nodes)))
        if spec.launch_method == "deepspeed" and not single
        else [],
        "hosts_given": bool(spec.hosts),
        "ssh": spec.ssh,
        "gpus": None if spec.gpus is None else ",".join(map(str, spec.gpus)),
        "env_lines": environment_lines(spec.env, spec.launch_method),
        "preflight": spec.preflight,
        "module_flag": "--module" if spec.launch_method == "deepspeed" else "-m",
        # the deepspeed launcher adds --local_rank=N, which the preflight module does not take
        "preflight_module_flag": "--no_local_rank --module" if spec.launch_method == "deepspeed" else "-m",
    }


def _always_quoted(value: str | None) -> str | None:
    """shlex.quote, but quoted even when safe: shellcheck reads a bare `MASTER_ADDR=host-0` as arithmetic."""
    if value is None:
        return None
    quoted = shlex.quote(value)
    return f"'{value}'" if quoted == value else quoted


def literal_dollars(values: object) -> bool:
    """Whether a user value anywhere in `values` (a string, or dicts, lists and tuples of them) holds $ or a
    backtick: single-quoted on purpose, which shellcheck notes (SC2016)."""

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from strings(item)

    return any("$" in s or "`" in s for s in strings(values))


def build_launcher_script(spec: LaunchSpec, command_line: str, output: str = SCRIPTS["local"]) -> str:
    """The script for one node; `command_line` (how to regenerate it) and `output` go in its header."""
    check_launch(spec)
    context = launch_context(spec)
    if spec.ssh:
        context["node_rank"] = 0  # pdsh starts every node from node 0
    context["literal_dollars"] = literal_dollars(context)
    return render(
        "run_training.sh.j2",
        command_line=command_line,
        output_name=output if output not in (None, "-") else SCRIPTS["local"],
        **context,
    )

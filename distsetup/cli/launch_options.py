"""The options `distsetup launcher`, `distsetup slurm` and `distsetup job` share (what runs, with which backend and
launcher, on how many GPUs), and what the three say of what they read and how they were called: one place for the
three, as options.py is for all. launch_spec.py turns the options into a LaunchSpec."""

import shlex
from pathlib import Path

import click

from distsetup.cli.options import IntegerRange, option, positive, stack, switch
from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import MAX_TIMEOUT_MINUTES
from distsetup.scripts.environment import NCCL_DEBUG_LEVELS
from distsetup.scripts.launch_plan import DEFAULT_TRAINER, LAUNCH_METHODS, LaunchSpec
from distsetup.scripts.shell_words import one_line_word


class GpuCount(click.ParamType):
    """A positive integer or `auto`."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor auto.", param, ctx)
        return number


# What the options below say in `distsetup launcher` and `distsetup slurm`, which write a script: {option: help}.
SCRIPT_WORDING = {
    "launch_method": {"help": "torchrun (no SSH), the deepspeed launcher, or accelerate."},
    "num_gpus_per_node": {
        "help": "Processes per node: a number (CPU processes on a machine without GPUs) or auto (every visible GPU) "
        "[auto, or the count of --gpus]."
    },
    "master_port": {"help": "Rendezvous port [29500; a free one on one node; under SLURM derived from the job id]."},
    "dry_run": {"help": "Print the script and write nothing."},
}
# ... in `distsetup slurm`, whose job asks SLURM for the GPUs of each node
SLURM_WORDING = {
    **SCRIPT_WORDING,
    "num_gpus_per_node": {
        "metavar": "N",
        "help": "Processes per node, and the GPUs each node asks SLURM for (CPU processes with --gpu_request none) "
        "[1, said in a note].",
    },
}
# ... and in `distsetup job`, whose nodes all run torchrun, in pods or SkyPilot nodes that ask for the GPUs.
JOB_WORDING = {
    "launch_method": {
        "metavar": "torchrun",
        "help": "The only launcher a job runs (DeepSpeed and FSDP runs train under it too).",
    },
    "num_gpus_per_node": {
        "metavar": "N",
        "help": "Processes per node, and the GPUs each node asks for (CPU processes on nodes without GPUs).",
    },
    "master_port": {"help": "Rendezvous port, on jobset and skypilot [29500]; trainjob and pytorchjob set their own."},
    "dry_run": {"help": "Print the file and write nothing."},
}


def shared_launch_options(wording: dict[str, dict[str, str]]):
    """The options `distsetup launcher`, `slurm` and `job` share (what to run, with which backend and launcher, on
    how many GPUs), with `wording`'s help and metavar for those that read otherwise in each."""
    return stack(
        option(
            "config",
            type=click.Path(dir_okay=False),
            help="Run config (config.yaml) [config/config.yaml where it exists]; its backend is used unless "
            "--use_deepspeed / --use_fsdp or a backend's file (--deepspeed_config / --fsdp_config) is given.",
        ),
        option("use_deepspeed", is_flag=True, help="Train with DeepSpeed (needs --deepspeed_config or the config's)."),
        option("use_fsdp", is_flag=True, help="Train with FSDP."),
        option(
            "deepspeed_config", type=click.Path(dir_okay=False), help="DeepSpeed JSON (from `distsetup deepspeed`)."
        ),
        option("fsdp_config", type=click.Path(dir_okay=False), help="FSDP JSON (from `distsetup fsdp`)."),
        option(
            "launch_method",
            type=click.Choice(LAUNCH_METHODS),
            default="torchrun",
            show_default=True,
            **wording["launch_method"],
        ),
        option(
            "script",
            help=f"Your own training script (python FILE) instead of distsetup's trainer "
            f"(python -m {DEFAULT_TRAINER}, the default).",
        ),
        option("python_module", help="Your own training module (python -m MODULE) instead of distsetup's trainer."),
        option("num_gpus_per_node", type=GpuCount(), **wording["num_gpus_per_node"]),
        option("num_nodes", type=int, default=1, show_default=True, help="Nodes in the world."),
        option("master_port", type=int, **wording["master_port"]),
        option("omp_num_threads", type=positive, help="OMP_NUM_THREADS for every process."),
        option("nccl_debug", type=click.Choice(NCCL_DEBUG_LEVELS), help="NCCL_DEBUG level."),
        option("nccl_socket_ifname", help="NCCL_SOCKET_IFNAME, the network interface between nodes."),
        switch("nccl_ib_disable", default=None, help="NCCL_IB_DISABLE=1 (TCP instead of InfiniBand)."),
        option(
            "timeout_minutes",
            type=IntegerRange(1, MAX_TIMEOUT_MINUTES),
            help="Collective timeout (distributed.timeout_minutes).",
        ),
        option("cuda_device_max_connections", type=positive, help="CUDA_DEVICE_MAX_CONNECTIONS."),
        option(
            "preflight",
            is_flag=True,
            help="Run `python -m distsetup.preflight` (all-reduce + barrier) across the same world before training.",
        ),
        option("dry_run", is_flag=True, **wording["dry_run"]),
    )


launch_options = shared_launch_options(SCRIPT_WORDING)
slurm_launch_options = shared_launch_options(SLURM_WORDING)
job_launch_options = shared_launch_options(JOB_WORDING)


def launch_inputs(spec: LaunchSpec) -> dict[str, str | None]:
    """The files a launch reads, which its script must never be written over: {what: path}."""
    return {
        "run config": spec.config,
        "DeepSpeed config": spec.deepspeed_config,
        "FSDP config": spec.fsdp_config,
        "training script": spec.script,
    }


def script_notes(spec: LaunchSpec, run_command: str | None) -> list[str]:
    """A --script that names no file in the folder the script starts it from: refused where it is a file followed by
    its arguments, a note otherwise (it may come later, or from another checkout; the script checks again when it
    starts). `run_command`: how the written script is run, with the arguments after it (None: a job, whose nodes pass
    none). Not for a Kubernetes job, whose script is in the image."""
    if spec.script is None or spec.workdir is None or (Path(spec.workdir) / spec.script).is_file():
        return []
    if (Path(spec.workdir) / spec.script).is_dir():
        raise DistsetupError(f"--script {spec.script} is a folder.", "give the training script's file, e.g. train.py.")
    program, _, arguments = spec.script.partition(" ")
    # a file there, or a Python file's name followed by more (not yet written: "train.py --epochs 3")
    named_then_arguments = (Path(spec.workdir) / program).is_file() or (
        program.endswith(".py") and (not spec.script.endswith(".py") or arguments.startswith("-"))
    )
    if arguments and named_then_arguments:
        passed = (
            f"and the arguments when you run it: {run_command} {arguments}"
            if run_command
            else "and read its settings from the run config or the environment (--env): a job's nodes pass it none"
        )
        raise DistsetupError(
            f"--script {spec.script!r} is a file name followed by arguments.",
            f"give --script {shlex.quote(program)}, {passed}.",
        )
    return [f"--script {spec.script}: no such file in {spec.workdir} yet; the script stops with one line until it is."]


def venv_warnings(venv: str | None, workdir: str | None) -> list[str]:
    """A --venv without bin/activate in the folder the SLURM script starts from (where distsetup runs): a warning,
    not a refusal (the venv may be the cluster's only); the job's batch shell checks again and stops in one line."""
    if venv is None or (Path(workdir or ".") / venv / "bin" / "activate").is_file():
        return []
    return [
        f"--venv {venv}: no bin/activate there on this machine; the job activates it on its first node, and stops "
        "with one line where there is none."
    ]


def regenerate_command(name: str) -> str:
    """`distsetup NAME --option value ...` for the options given on the command line (for the header)."""
    ctx = click.get_current_context()
    words, after = ["distsetup", name], []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        value = ctx.params.get(param.name)
        if source in (None, click.core.ParameterSource.DEFAULT) or value is None:
            continue
        if isinstance(param, click.Argument):  # the program's arguments, after --
            after += ["--", *map(one_line_word, value)] if value else []
            continue
        flag = getattr(param, "new_flag", None) or param.opts[0].split("/")[0]  # an old spelling: the new one
        if getattr(param, "is_flag", False):
            words.append(flag if value else param.secondary_opts[0] if param.secondary_opts else "")
        else:
            for item in value if isinstance(value, (list, tuple)) else [value]:
                words += [flag, one_line_word(str(item))]
    return " ".join(w for w in words + after if w)

"""`distsetup init`: ask (or take from flags) what a run needs, let the planner choose how to spread it, and
write the run config, the DeepSpeed or FSDP file and the launcher or sbatch script."""

import sys
from collections.abc import Callable
from pathlib import Path

import click

from distsetup.cli.init_setup import (
    SCHEDULERS,
    Answers,
    build_setup,
    hf_config_path,
    refuse_existing,
    write_setup,
)
from distsetup.cli.launch_spec import working_folder
from distsetup.cli.machine import Machine, this_machine
from distsetup.cli.options import IntegerRange, option, positive
from distsetup.errors import DistsetupError
from distsetup.formats.batch import MAX_NODES, MAX_PROCESSES_PER_NODE, per_rank_batch
from distsetup.formats.default_paths import RUN_CONFIG, SCRIPTS
from distsetup.formats.runconfig import DATA_SUFFIXES, MODEL_MAXIMA, PRECISIONS, DataConfig
from distsetup.formats.runconfig_rules import data_file_problems
from distsetup.planning.models import BUILTIN_SIZES, hf_shape_from_json
from distsetup.planning.units import MAX_BATCH, parse_memory
from distsetup.scripts.sbatch import check_account, check_partition, time_limit_seconds

NO_GPU = "none"

SLURM_ONLY = ("partition", "time_limit", "account", "venv", "cpus_per_task")  # the flags only a SLURM job reads


@click.command(
    "init",
    epilog="""\b
Examples:
  distsetup init                                  # asks, in a terminal; every answer has a default
  distsetup init --yes --model models/my-llama --num_gpus_per_node 8 --num_nodes 2 --scheduler slurm \\
      --partition gpu --time_limit 24:00:00       # the same without questions (scripts, CI)
Writes config/config.yaml, config/ds_config.json or config/fsdp_config.json (when the plan needs one) and
scripts/run_training.sh or scripts/slurm_job.sh; never over an existing file without --force.
""",
)
@option("model", help=f"A built-in size ({', '.join(BUILTIN_SIZES)}) or a local Hugging Face model folder.")
@option("data", help=f"Training files, comma-separated ({', '.join(DATA_SUFFIXES)}), or synthetic.")
@option("scheduler", type=click.Choice(SCHEDULERS), help="Where it runs: this machine (local) or SLURM.")
@option("num_nodes", type=IntegerRange(1, MAX_NODES), help="Nodes [the SLURM allocation's, else 1].")
@option(
    "num_gpus_per_node",
    type=IntegerRange(1, MAX_PROCESSES_PER_NODE),
    help="GPUs per node, or CPU processes in a CPU setup [this machine's].",
)
@option("gpu_memory", help=f"Memory of one GPU, e.g. 80GB; {NO_GPU}: a CPU setup [this machine's GPUs].")
@option("precision", type=click.Choice(PRECISIONS), help="bf16 (GPUs from Ampere on), fp16 or fp32.")
@option("global_batch_size", type=IntegerRange(1, MAX_BATCH), help="Samples per optimizer step [8 per process].")
@option("partition", help="SLURM partition [the allocation's, else the cluster's default].")
@option("time_limit", help="SLURM time limit, e.g. 24:00:00.")
@option("account", help="SLURM account to charge [the allocation's, else none].")
@option("venv", help="Virtual environment the SLURM job activates [the active one].")
@option("cpus_per_task", type=positive, help="CPUs of each SLURM node's task (its launcher and processes).")
@option("max_steps", type=positive, default=1000, show_default=True, help="Optimizer steps of the run.")
@option("seq_len", type=IntegerRange(2, MODEL_MAXIMA["block_size"]), help="Tokens per sample [the model's].")
@option("yes", "-y", is_flag=True, help="Ask nothing: defaults for every answer not given as a flag.")
@option("force", is_flag=True, help="Replace files that exist.")
def init(yes: bool, force: bool, **given):
    """Ask what the run needs, choose the strategy with the planner, and write every file to start it."""
    refuse_existing([RUN_CONFIG], force)  # before any question: the answers would be lost
    machine = this_machine()
    try:
        answers = ask_everything(Questions(given, yes, force), machine)
    except click.Abort:  # Ctrl-C or the end of input at a question: Click would say only "Aborted!"
        raise DistsetupError("init stopped at a question: nothing was written.", "run it again to answer them.")
    setup = build_setup(answers, working_folder())
    write_setup(setup.files, force)
    for remark in setup.remarks:
        click.echo(remark, err=True)
    for line in setup.summary:
        click.echo(line)
    click.echo("Wrote " + ", ".join(setup.files))
    click.echo(f"Next: {setup.next_command}")


class Questions:
    """Each answer from its flag, else the default (--yes), else the terminal, asked again until valid."""

    def __init__(self, given: dict, yes: bool, force: bool = False):
        self.given, self.yes, self.force = given, yes, force

    def answer(self, name: str, text: str, default, kind=None, check: Callable | None = None):
        if self.given.get(name) is not None:
            value = self.given[name]
            return check(value) if check else value
        if self.yes:
            return check(default) if check else default
        if not sys.stdin.isatty():
            raise DistsetupError(
                f"distsetup init would ask for --{name}, and stdin is not a terminal.",
                "add --yes (defaults for every answer not given as a flag), or run it in a terminal.",
            )
        return click.prompt(
            text, default=default, value_proc=_reasked(kind, check, name), show_default=default not in ("", None)
        )


def _reasked(kind, check: Callable | None, name: str) -> Callable:
    """A prompt's conversion: a value that fails `kind` or `check` is said and asked again (spaces around it are no
    part of the answer). The check's message names the flag (`--data: ...`), which is left out here: at a question the
    answer was typed, not the flag."""
    flag = f"--{name}"
    convert = click.types.convert_type(kind)

    def proc(text):
        value = convert(text.strip() if isinstance(text, str) else text)
        if check is None:
            return value
        try:
            return check(value)
        except DistsetupError as e:
            said = e.message.removeprefix(flag).lstrip(": ") if e.message.startswith(flag) else e.message
            raise click.BadParameter(said) from None

    return proc


def what_this_machine_has(machine: Machine) -> str:
    if machine.gpus:
        return f"This machine: {len(machine.gpus)} GPU(s) ({', '.join(sorted({g.name for g in machine.gpus}))})."
    reason = (machine.no_gpu_reason or "").rstrip(".")
    return f"This machine: no GPU ({reason}). A CPU setup, unless you give the memory of the run's GPUs."


def ask_everything(q: Questions, machine: Machine) -> Answers:
    """Every answer a setup needs, in the order a person would give them."""
    if q.given.get("scheduler"):  # said before any question where the flag says it
        refuse_slurm_flags(q, q.given["scheduler"])
    if not q.yes:  # under --yes the summary says what was chosen; an error stays one line
        click.echo(what_this_machine_has(machine), err=True)
    model = q.answer(
        "model", f"Model: a built-in size ({', '.join(BUILTIN_SIZES)}) or a Hugging Face folder", "tiny", str, _model
    )
    data = q.answer("data", "Training data: files (comma-separated) or synthetic", "synthetic", str, _data)
    scheduler = q.answer(
        "scheduler",
        f"Where it runs ({', '.join(SCHEDULERS)})",
        "slurm" if machine.in_slurm_job else "local",
        click.Choice(SCHEDULERS, case_sensitive=False),
    )
    refuse_existing([SCRIPTS[scheduler]], q.force)  # before more questions
    refuse_slurm_flags(q, scheduler)
    num_nodes = q.answer(
        "num_nodes", "Nodes", machine.slurm_count("SLURM_JOB_NUM_NODES") or 1, IntegerRange(1, MAX_NODES)
    )
    gpu_memory = _ask_gpu_memory(q, machine, scheduler)
    per_node_default = (
        machine.slurm_count("SLURM_GPUS_ON_NODE")
        or len(machine.gpus)
        or (1 if gpu_memory is not None else min(2, machine.cpu_count))
    )
    per_node = q.answer(
        "num_gpus_per_node",
        "GPUs per node" if gpu_memory else "CPU processes per node",
        per_node_default,
        IntegerRange(1, MAX_PROCESSES_PER_NODE),
    )
    precision_default = machine.precision if machine.gpus or not gpu_memory else "bf16"
    precision = q.answer(
        "precision",
        f"Precision ({', '.join(PRECISIONS)})",
        precision_default,
        click.Choice(PRECISIONS, case_sensitive=False),
    )
    global_batch = _ask_global_batch(q, num_nodes, per_node)
    slurm = _ask_slurm(q, machine) if scheduler == "slurm" else {}
    return Answers(
        model=model,
        data=data,
        scheduler=scheduler,
        num_nodes=num_nodes,
        num_gpus_per_node=per_node,
        gpu_memory=gpu_memory,
        precision=precision,
        global_batch_size=global_batch,
        max_steps=q.given.get("max_steps") or 1000,
        seq_len=q.given.get("seq_len"),
        **{key: value or None for key, value in slurm.items()},
    )


def refuse_slurm_flags(q: Questions, scheduler: str) -> None:
    """A SLURM job's flags given for a scheduler that reads none of them (dropped without a word)."""
    unread = [name for name in SLURM_ONLY if q.given.get(name) is not None] if scheduler != "slurm" else []
    if unread:
        raise DistsetupError(
            f"--{unread[0]} is for a SLURM job, and --scheduler {scheduler} runs on this machine.",
            f"drop --{unread[0]}, or give --scheduler slurm.",
        )


def _ask_gpu_memory(q: Questions, machine: Machine, scheduler: str) -> str | None:
    """One GPU's memory (None: a CPU setup); the default is this machine's, and none on a SLURM login node."""
    if machine.gpu_memory:
        memory_default: str | None = f"{machine.gpu_memory / 1e9:.1f}GB"
    elif scheduler == "slurm" and not machine.in_slurm_job:
        memory_default = None  # a login node without GPUs says nothing about the cluster's: ask, never assume CPUs
        if q.yes and q.given.get("gpu_memory") is None:
            raise DistsetupError(
                "no GPU here to measure, and --gpu_memory is not given for the SLURM nodes.",
                f"give --gpu_memory (e.g. 80GB) for GPU nodes, or --gpu_memory {NO_GPU} for a CPU job.",
            )
    else:
        memory_default = NO_GPU
    return q.answer(
        "gpu_memory",
        f"Memory of one GPU, e.g. 80GB ({NO_GPU}: train on CPU processes)",
        memory_default,
        str,
        _gpu_memory,
    )


def _ask_global_batch(q: Questions, num_nodes: int, per_node: int) -> int:
    """Samples per optimizer step, a multiple of the processes (8 per process by default)."""

    def divides(batch: int) -> int:
        per_rank_batch(batch, num_nodes, per_node)
        return batch

    return q.answer(
        "global_batch_size",
        "Global batch (samples per optimizer step)",
        8 * num_nodes * per_node,
        IntegerRange(1, MAX_BATCH),
        divides,
    )


def _ask_slurm(q: Questions, machine: Machine) -> dict:
    """The SLURM job's partition, time limit and account (defaults: the allocation's), venv and CPUs per task."""
    return {
        "partition": q.answer(
            "partition",
            "SLURM partition (empty: the default)",
            machine.slurm.get("SLURM_JOB_PARTITION", ""),
            str,
            _named(check_partition),
        ),
        "time_limit": q.answer("time_limit", "SLURM time limit", "24:00:00", str, _time_limit),
        "account": q.answer(
            "account",
            "SLURM account (empty: none)",
            machine.slurm.get("SLURM_JOB_ACCOUNT", ""),
            str,
            _named(check_account),
        ),
        "venv": q.given.get("venv") or machine.venv,
        "cpus_per_task": q.given.get("cpus_per_task"),
    }


def _model(value: str) -> str:
    """A built-in size, or a folder whose config.json describes a decoder: checked at its question, not after the
    last (which lost every answer)."""
    value = value.strip()
    if value not in BUILTIN_SIZES:
        hf_shape_from_json(hf_config_path(value), None)
    return value


def _data(value: str) -> tuple[str, ...]:
    """Files the run config takes, each there and of a kind it reads (checked here, not after the last question)."""
    if value.strip() == "synthetic":
        return ()
    paths = tuple(p.strip() for p in value.split(",") if p.strip())
    kinds = f"{', '.join(DATA_SUFFIXES)} files"
    if not paths:
        raise DistsetupError(f"--data {value!r} names no file.", f"give {kinds}, or synthetic.")
    for path in paths:
        if Path(path).is_dir():
            raise DistsetupError(f"--data: {path} is a folder.", f"name its files ({kinds}), comma-separated.")
    for problem in data_file_problems(DataConfig(type="files", paths=list(paths)), None):  # the run config's rule
        raise DistsetupError(f"--data: {problem.message}", f"give {kinds} (records with 'text'), or synthetic.")
    return paths


def _named(check: Callable[[str | None], None]) -> Callable[[str], str]:
    """A SLURM name's answer (empty: none), checked as `distsetup slurm` checks it."""

    def checked(value: str) -> str:
        check(value.strip() or None)
        return value.strip()

    return checked


def _gpu_memory(value: str) -> str | None:
    if value.strip().lower() == NO_GPU:
        return None
    parse_memory(value)
    return value.strip()


def _time_limit(value: str) -> str:
    try:
        time_limit_seconds(value)
    except DistsetupError as e:
        raise DistsetupError(f"--time_limit: {e.problem}", e.hint) from None
    return value.strip()

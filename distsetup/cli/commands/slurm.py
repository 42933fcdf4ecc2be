"""`distsetup slurm`: write scripts/slurm_job.sh, which runs one training world over all nodes of a job."""

import shlex
import subprocess
from pathlib import Path

import click

from distsetup.cli.launch_options import (
    launch_inputs,
    regenerate_command,
    script_notes,
    slurm_launch_options,
    venv_warnings,
)
from distsetup.cli.launch_spec import launch_spec_from_options
from distsetup.cli.options import option, positive, renamed, take_renamed
from distsetup.cli.output import emit
from distsetup.errors import DistsetupError
from distsetup.formats.default_paths import SCRIPTS
from distsetup.scripts.launch_flags import parse_env_pairs
from distsetup.scripts.sbatch import GPU_REQUESTS, SlurmSpec, build_slurm_script, parse_sbatch_pairs, slurm_warnings


@click.command(
    epilog="""\b
Examples:
  distsetup slurm --config config.yaml --num_nodes 4 --num_gpus_per_node 8 --use_deepspeed \\
      --time_limit 48:00:00 --partition gpu
  distsetup slurm --config config.yaml --num_nodes 2 --num_gpus_per_node 4 --requeue \\
      --env_module cuda/12.4 --venv .venv --env WANDB_MODE=offline --submit
  distsetup slurm --script my_train.py --num_nodes 2 --num_gpus_per_node 8   # your own script
"""
)
@slurm_launch_options
@option("job_name", default="distsetup", show_default=True, help="#SBATCH --job-name.")
@option(
    "gpu_request",
    type=click.Choice(GPU_REQUESTS),
    default="gres",
    show_default=True,
    help="Ask for GPUs with --gres=gpu:N, --gpus-per-node=N, or not at all (CPU jobs).",
)
@option("gpu_type", help="GPU type in the request, e.g. a100 (--gres=gpu:a100:N).")
@option("cpus_per_task", type=positive, help="CPUs for each node's launcher and its processes.")
@option("mem", help="Memory per node, e.g. 256G.")
@option("mem_per_gpu", help="Memory per GPU, e.g. 64G (instead of --mem).")
@option("time_limit", help="Wall time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED.")
@option("partition", help="Partition (queue).")
@option("account", help="Account to charge.")
@option("qos", help="Quality of service.")
@option("constraint", help="Node features, e.g. a100&ib.")
@option("exclusive", is_flag=True, help="Whole nodes only.")
@option("log_output", default="%x-%j.out", show_default=True, help="Job log (#SBATCH --output); %x name, %j id.")
@option("log_error", help="Separate error log (#SBATCH --error).")
@option("mail_user", help="Mail address for job events.")
@option("mail_type", help="Job events to mail, e.g. END,FAIL.")
@option(
    "sbatch",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any other #SBATCH option (repeatable); options "
    "with a flag of their own (nodes, time, gres, ...) are refused.",
)
@option("env_module", multiple=True, help="Environment module to `module load` before training (repeatable).")
@renamed("module", "env_module", multiple=True)
@option("conda_env", help="Conda environment to activate.")
@option("venv", help="Python virtual environment folder to activate.")
@option("env", multiple=True, metavar="KEY=VALUE", help="Export a variable (repeatable).")
@option("requeue", is_flag=True, help="On preemption or near the time limit: checkpoint, requeue, resume.")
@option(
    "signal_seconds",
    type=positive,
    help="With --requeue: seconds before the time limit that SLURM signals the job; torchrun gives the "
    "processes this less 30 s to checkpoint [120].",
)
@option("submit", is_flag=True, help="Run sbatch on the written script and print the job id.")
@option(
    "output",
    "-o",
    type=click.Path(dir_okay=False),
    default=SCRIPTS["slurm"],
    show_default=True,
    help="Script to write; '-' prints it.",
)
def slurm(output, dry_run, submit, **opts):
    """Write a SLURM batch script: srun starts one launcher per node and all nodes form one world.

    It runs distsetup's trainer (python -m distsetup.train) unless --script or --python_module names your own,
    and can be submitted from any folder: it first enters the folder it was written in, which relative paths
    (and --venv) refer to.
    """
    if submit and (dry_run or output in (None, "-")):
        raise DistsetupError("--submit needs a script file.", "drop --dry_run / -o - or drop --submit.")
    spec, notes = slurm_spec_from_options(opts)
    run_command = f"sbatch {shlex.quote(str(output))}"
    notes += script_notes(spec.launch, run_command)
    text = build_slurm_script(spec, command_line=regenerate_command("slurm"), output=output)
    # launch_warnings are the launcher script's: SLURM names the nodes (the deepspeed launcher's hostfile too)
    warnings = slurm_warnings(spec) + venv_warnings(spec.venv, spec.launch.workdir)
    remarks = [f"Note: {note}" for note in notes] + [f"Warning: {w}" for w in warnings]
    emit(
        text,
        output,
        dry_run,
        next_step=None if submit else run_command,
        executable=True,
        inputs=launch_inputs(spec.launch),
        remarks=remarks,
    )
    if submit:
        click.echo(submit_job(output))


def slurm_spec_from_options(o: dict) -> tuple[SlurmSpec, list[str]]:
    if o["num_gpus_per_node"] == "auto":
        raise DistsetupError(
            "distsetup slurm needs a number for --num_gpus_per_node, not auto.", "e.g. --num_gpus_per_node 8."
        )
    o = dict(o)
    if o["signal_seconds"] is not None and not o["requeue"]:  # given, and dropped without a word
        raise DistsetupError(
            "--signal_seconds is read only with --requeue.", "add --requeue, or drop --signal_seconds."
        )
    if o["gpu_type"] is not None and o["gpu_request"] == "none":
        raise DistsetupError(
            f"--gpu_type {o['gpu_type']} names the GPUs asked for, and --gpu_request none asks for none.",
            "drop --gpu_type, or ask for GPUs (--gpu_request gres or gpus-per-node).",
        )
    take_renamed(o, "module", "env_module")
    launch_opts = dict(o, env_pairs=parse_env_pairs(o["env"]))
    launch_opts["num_gpus_per_node"] = 1 if o["num_gpus_per_node"] is None else o["num_gpus_per_node"]
    launch, notes = launch_spec_from_options(launch_opts, slurm=True)
    if o["num_gpus_per_node"] is None:  # a node of 8 GPUs would train on one, without a word
        asked = "" if o["gpu_request"] == "none" else ", with 1 GPU each node asks for"
        notes.insert(0, f"--num_gpus_per_node not given: 1 process a node{asked}.")
    return SlurmSpec(
        launch=launch,
        job_name=o["job_name"],
        gpu_request=o["gpu_request"],
        gpu_type=o["gpu_type"],
        cpus_per_task=o["cpus_per_task"],
        mem=o["mem"],
        mem_per_gpu=o["mem_per_gpu"],
        time_limit=o["time_limit"],
        partition=o["partition"],
        account=o["account"],
        qos=o["qos"],
        constraint=o["constraint"],
        exclusive=o["exclusive"],
        log_output=o["log_output"],
        log_error=o["log_error"],
        mail_user=o["mail_user"],
        mail_type=o["mail_type"],
        extra_sbatch=parse_sbatch_pairs(o["sbatch"]),
        modules=tuple(o["env_module"]),
        conda_env=o["conda_env"],
        venv=o["venv"],
        requeue=o["requeue"],
        **({"signal_seconds": o["signal_seconds"]} if o["signal_seconds"] is not None else {}),
    ), notes


def submit_job(script: str) -> str:
    """`sbatch --parsable SCRIPT` -> the job id; a clear error when sbatch is missing or refuses."""
    try:
        result = subprocess.run(["sbatch", "--parsable", str(Path(script))], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise DistsetupError("sbatch is not installed here.", f"copy {script} to a SLURM login node and run sbatch.")
    if result.returncode != 0:
        raise DistsetupError(f"sbatch refused {script}: {result.stderr.strip()}", "fix the #SBATCH lines or options.")
    return result.stdout.strip().split(";")[0]

"""`distsetup job`: the run as a Kubernetes job (Kubeflow Trainer's TrainJob, a JobSet or a PyTorchJob), one file
that `kubectl apply -f` submits whole: the run config, its backend file and the entry point in a ConfigMap, the
volume the run works in, and the engine's object, set to restart the world as one after a preemption; or as a
SkyPilot task, which `sky jobs launch` runs as a managed job."""

import contextlib
import io

import click

from distsetup.cli.launch_options import (
    job_launch_options,
    launch_inputs,
    regenerate_command,
    script_notes,
)
from distsetup.cli.launch_spec import launch_spec_from_options
from distsetup.cli.options import IntegerRange, checked, option, positive
from distsetup.cli.output import emit, refuse_generated_problems
from distsetup.errors import DistsetupError
from distsetup.jobs.entry import output_note
from distsetup.jobs.manifest import default_output, job_documents, manifest_text, submit_command
from distsetup.jobs.rules import manifest_problems
from distsetup.jobs.spec import BUCKET_MOUNT, KUBERNETES_ONLY, SKYPILOT_ONLY, TARGETS, JobSpec, check_flags_given
from distsetup.scripts.launch_flags import parse_env_pairs


@click.command(
    epilog="""\b
Examples:
  distsetup job --target trainjob --config config.yaml --num_nodes 4 --num_gpus_per_node 8 \\
      --image ghcr.io/me/train:1.0 --name llm-run-1
  distsetup job --target jobset --config config.yaml --num_nodes 2 --num_gpus_per_node 8 \\
      --image ghcr.io/me/train:1.0 --checkpoint_claim shared-runs --grace_seconds 600 --checkpoint_seconds 240
  distsetup job --target skypilot --config config.yaml --num_nodes 2 --num_gpus_per_node 8 \\
      --accelerator H100 --checkpoint_bucket s3://my-bucket/runs --use_spot --setup 'pip install -r requirements.txt'
"""
)
@option(
    "target",
    type=click.Choice(TARGETS),
    help="The engine: trainjob (Kubeflow Trainer v2), jobset (JobSet), pytorchjob (Kubeflow training-operator v1), "
    "skypilot (a SkyPilot task).",
)
@job_launch_options
@option(
    "image",
    help="Container image with Python, torch and distsetup (and your code and data) installed; on SkyPilot, a Docker "
    "image (resources.image_id), or --setup.",
)
@option("name", default="distsetup", show_default=True, help="The job's name (a DNS label; pods are named after it).")
@option("namespace", help="Namespace of every object (else kubectl's current one).")
@option(
    "gpu_resource",
    help="The resource each pod asks --num_gpus_per_node of; 'none' for CPU pods [nvidia.com/gpu].",
)
@option(
    "checkpoint_claim",
    help="An existing ReadWriteMany PersistentVolumeClaim to work in [a claim NAME-work is written].",
)
@option("checkpoint_storage", help="Size of the claim written [100Gi].")
@option("storage_class", help="StorageClass of the claim written (one that offers ReadWriteMany).")
@option("shm_size", help="/dev/shm of each pod (memory-backed; 64 MB otherwise) [16Gi].")
@option(
    "grace_seconds",
    type=positive,
    default=300,
    show_default=True,
    help="terminationGracePeriodSeconds: how long a pod has after SIGTERM to checkpoint and exit.",
)
@option(
    "checkpoint_seconds",
    type=positive,
    default=60,
    show_default=True,
    help="The longest a checkpoint takes (the largest of summary.json's checkpoint_stalls, with synchronous "
    "checkpoints; twice that under training.async_checkpoint); the grace period must fit it.",
)
@option(
    "max_restarts",
    type=IntegerRange(min=0),
    help="Restarts after failures; preemptions do not count [3; a PyTorchJob's operator has no limit].",
)
@option("accelerator", help="SkyPilot: the GPU type, e.g. H100 (--num_gpus_per_node of them); none for CPU nodes.")
@option("checkpoint_bucket", help="SkyPilot: the bucket the run works in, e.g. s3://my-bucket/runs.")
@option("use_spot", is_flag=True, help="SkyPilot: spot instances (preempted, then recovered and resumed).")
@option(
    "setup",
    metavar="COMMANDS",
    help="SkyPilot: what installs Python, torch and distsetup on each node, e.g. 'pip install -r requirements.txt' "
    "(or --image).",
)
@option("env", multiple=True, metavar="KEY=VALUE", help="Export a variable on every node (repeatable).")
@option(
    "output",
    "-o",
    type=click.Path(dir_okay=False),
    help="File to write; '-' prints it [k8s/TARGET.yaml; sky/task.yaml].",
)
@click.argument("program_args", nargs=-1, type=checked(click.UNPROCESSED), metavar="[-- ARGS...]")
def job(target, output, dry_run, program_args, **opts):
    """Write a Kubernetes job or a SkyPilot task: every node of ONE torchrun world, restarted as one and resumed
    after a preemption.

    Arguments after `--` go to the program on every node (your script's, or the trainer's overrides such as
    training.max_steps=1000), as `bash run_training.sh ARGS` passes them.

    Each node runs an entry point that reads the engine's variables, starts torchrun, forwards SIGTERM and exits
    143 once the world has checkpointed, which the engine restarts on. On Kubernetes the run config and its backend
    file travel in a ConfigMap, and the run works in a shared volume, where its output_dir and checkpoints live; on
    SkyPilot the folder distsetup runs in is the workdir, and the output goes to the checkpoint bucket.
    """
    if target is None:
        raise DistsetupError("distsetup job needs --target.", f"name the engine: --target {'|'.join(TARGETS)}.")
    output = output or default_output(target)
    # a pod's data and code come with its image or volume (SkyPilot's with the workdir, this folder)
    files_here = target == "skypilot"
    launch, notes = launch_spec_from_options(dict(opts, env_pairs=parse_env_pairs(opts["env"])), files_here=files_here)
    if launch.script is None and launch.runs_default_trainer:  # a script named src/train.py may be the user's
        _check_trainer_arguments(program_args)
    given = {key: opts[key] for key in (*KUBERNETES_ONLY, *SKYPILOT_ONLY) if opts[key] not in (None, False)}
    check_flags_given(target, list(given))
    given.update({key: "" for key in ("gpu_resource", "accelerator") if given.get(key) == "none"})  # CPU nodes
    spec = JobSpec(
        target=target,
        name=opts["name"],
        launch=launch,
        image=opts["image"],
        grace_seconds=opts["grace_seconds"],
        checkpoint_seconds=opts["checkpoint_seconds"],
        max_restarts=opts["max_restarts"],
        program_args=tuple(program_args),
        **given,
    )
    if target == "skypilot" and not launch.runs_default_trainer:  # the program comes from this folder
        notes += script_notes(launch, run_command=None)
        notes.append(
            f"a node's disk goes with the node: your program writes what a recovered job resumes from under "
            f"{BUCKET_MOUNT} (the bucket), as distsetup's trainer does."
        )
    if note := output_note(spec):
        notes.append(note)
    command_line = regenerate_command("job")
    objects = job_documents(spec, command_line)
    refuse_generated_problems(manifest_problems(objects))
    submit = submit_command(spec, output if output != "-" else default_output(target))
    emit(
        manifest_text(objects, command_line, submit),
        output,
        dry_run,
        next_step=submit,
        inputs=launch_inputs(launch),
        remarks=[f"Note: {note}" for note in notes],
    )


def _check_trainer_arguments(program_args: tuple[str, ...]) -> None:
    """The trainer's arguments after `--`, read as it reads them (its options, then `section.key=value` overrides of
    run config keys, each of its type): every node's check would refuse them, and the engine restart the world to the
    same refusal. Files and rules across keys are left to the pod, whose image and volume hold the files."""
    from distsetup.formats.runconfig_load import override_problems
    from distsetup.train import parse_args  # no torch

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            args = parse_args(list(program_args))
    except SystemExit as e:
        if not e.code:  # --help
            return
        refused = said.getvalue().strip().splitlines()[-1].removeprefix("python -m distsetup.train: error: ")
        raise DistsetupError(f"the trainer's arguments after --: {refused}.", "see `python -m distsetup.train --help`.")
    overrides = args.overrides
    # the backend's file must travel in the job, which only its flag does
    backend_given = [override for override in overrides if override.partition("=")[0] in BACKEND_KEYS]
    backend_given += [f"--deepspeed {args.deepspeed}"] if args.deepspeed else []
    if backend_given:
        raise DistsetupError(
            f"{backend_given[0]} after --: the job's backend is its flags'.",
            "give --use_deepspeed/--use_fsdp and --deepspeed_config/--fsdp_config, which put the file in the job.",
        )
    if problems := override_problems(overrides):
        raise DistsetupError(f"after --: {problems[0].as_error().message}")


BACKEND_KEYS = {
    f"distributed.{key}" for key in ("backend", "use_deepspeed", "use_fsdp", "deepspeed_config", "fsdp_config")
}

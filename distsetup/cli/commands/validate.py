"""`distsetup validate`: report every problem in a DeepSpeed, FSDP or run config file, an Accelerate config or
TrainingArguments; `--resolve` shows what the HF Trainer puts in each "auto"."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import click

from distsetup.cli.options import IntegerRange, checked, option, positive, world_options
from distsetup.cli.output import write_atomic
from distsetup.errors import DistsetupError
from distsetup.formats.accelerate import default_config_note
from distsetup.formats.batch import world_size_from
from distsetup.formats.fix import fixed_run_config
from distsetup.formats.hf_trainer import Context, Resolved, TrainerValues, mismatch_problems, resolve_auto
from distsetup.formats.problems import Problem, as_json
from distsetup.formats.reading import read_config_text, read_json, yaml_mapping
from distsetup.formats.runconfig import MODEL_MAXIMA, resolve_config_path
from distsetup.formats.validate import KINDS, YAML_SUFFIXES, validate_file
from distsetup.jobs.files import JOB_KINDS, job_file_kind, validate_job_file

KIND_NAMES = {
    "deepspeed": "DeepSpeed config",
    "fsdp": "FSDP config",
    "run_config": "run config",
    "accelerate": "Accelerate config",
    "training_args": "TrainingArguments",
    "kubernetes": "Kubernetes manifest",
    "skypilot": "SkyPilot task",
}


@click.command(
    epilog="""\b
Examples:
  distsetup validate config/ds_config.json --world_size 16
  distsetup validate config.yaml
  distsetup validate ~/.cache/huggingface/accelerate/default_config.yaml --num_gpus_per_node 8
  distsetup validate training_args.json --world_size 16       # and the DeepSpeed file it names
  distsetup validate k8s/trainjob.yaml                        # TrainJob, JobSet, PyTorchJob and their parts
  distsetup validate k8s/jobset.yaml --crd jobset-crd.yaml    # and against the cluster's CRD
  distsetup validate ds_hf.json --hf --resolve --hidden_size 4096 --micro_batch_size 4 --world_size 16
"""
)
@click.argument("file", type=checked(click.Path(dir_okay=False, path_type=Path)))
@world_options
@option(
    "hf",
    is_flag=True,
    help='The file is for the HF Trainer: "auto" allowed where it fills it in; an FSDP spelling it refuses refused.',
)
@option("kind", type=click.Choice(KINDS + JOB_KINDS), help="Override the detected kind of file.")
@option(
    "crd",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A Kubernetes manifest: also check it against this CustomResourceDefinition file (repeatable), e.g. from "
    "`kubectl get crd trainjobs.trainer.kubeflow.org -o yaml`.",
)
@option("fix", is_flag=True, help="Rewrite a run config into distsetup's own keys, in place (comments kept).")
@option("resolve", is_flag=True, help='Show what the HF Trainer puts in each "auto" of the DeepSpeed file.')
@option("hidden_size", type=IntegerRange(1, MODEL_MAXIMA["n_embd"]), help="The model's hidden size (--resolve).")
@option("micro_batch_size", type=positive, help="per_device_train_batch_size (--resolve) [TrainingArguments'].")
@option("gradient_accumulation_steps", type=positive, help="(--resolve) [TrainingArguments', else 1].")
@option("max_steps", type=positive, help="Training steps, for the scheduler's (--resolve).")
@click.option("--json", "as_json_output", is_flag=True, help="Print the problems as JSON.")
@click.pass_context
def validate(ctx: click.Context, file: Path, world_size, num_nodes, num_gpus_per_node, hf, kind, as_json_output, **o):
    """Check FILE against the schema and DeepSpeed's, FSDP's, Accelerate's and the HF Trainer's rules; exit 1 on
    problems."""
    world = world_size_from(world_size, num_nodes, num_gpus_per_node)
    unread = [
        name for name in ("hidden_size", "micro_batch_size", "gradient_accumulation_steps", "max_steps") if o[name]
    ]
    if unread and not o["resolve"]:  # given, and dropped without a word
        raise DistsetupError(f"--{unread[0]} is read only with --resolve.", f"add --resolve, or drop --{unread[0]}.")
    if o["fix"]:
        fix(file, kind)
    job_kind = kind if kind in JOB_KINDS else job_file_kind(file) if kind is None else None
    if job_kind:
        kind, problems, data, notes = validate_job_file(file, job_kind, tuple(o["crd"]))
    elif o["crd"]:
        raise DistsetupError(f"--crd checks Kubernetes manifests; {file} is not one.", "drop --crd.")
    else:
        kind, problems, data, notes = validate_unknown_suffix(file, kind, world, hf, num_gpus_per_node)
    resolved, mismatched = resolve(file, kind, data, world, o) if o["resolve"] else ([], [])
    problems = problems + mismatched
    if as_json_output:
        if o["resolve"]:
            click.echo(
                json.dumps(
                    {"problems": json.loads(as_json(problems)), "resolved": [asdict(r) for r in resolved]}, indent=2
                )
            )
        else:
            click.echo(as_json(problems))
    else:
        for problem in problems:
            click.echo(f"{file}: {problem}")
        for note in filter(None, notes + ([default_config_note(file)] if kind == "accelerate" else [])):
            click.echo(f"{file}: note: {note}")
        for r in resolved:
            value = "?" if r.value is None else json.dumps(r.value)
            click.echo(f"{file}: resolve: {r.path} = {value} ({r.source})")
        checked = f" for world size {world}" if world and kind != "accelerate" else ""
        summary = f"{len(problems)} problem(s)" if problems else "no problems"
        click.echo(f"{file}: {KIND_NAMES[kind]}, {summary}{checked}.", err=bool(problems))
    ctx.exit(1 if problems else 0)


def validate_unknown_suffix(file: Path, kind: str | None, world, hf: bool, num_gpus_per_node):
    """validate_file; a file it cannot read whose name is no config's (run_training.sh) is said to be no config,
    not given JSON's syntax to fix."""
    try:
        return validate_file(file, kind, world, hf, num_gpus_per_node)
    except DistsetupError:
        if kind is not None or file.suffix in (".json", *YAML_SUFFIXES) or not file.is_file():
            raise
        raise DistsetupError(
            f"{file} is no config file validate reads: {', '.join(KIND_NAMES[k] for k in KINDS)} (JSON or YAML).",
            "give the config file (a script distsetup wrote reads the run config: validate that one).",
        ) from None


def fix(file: Path, kind: str | None) -> None:
    """Rewrite FILE (a run config) into distsetup's own keys, atomically, saying each change; then validate it."""
    yaml_kind = "run_config" if file.suffix in YAML_SUFFIXES and not job_file_kind(file) else None
    if (kind or yaml_kind) != "run_config":
        raise DistsetupError(f"--fix rewrites run configs (.yaml); {file} is not one.", "give the run config.")
    text = read_config_text(file, "run config")
    yaml_mapping(text, file)  # what it cannot read is said as validate says it, before the round trip reads it
    text, changes = fixed_run_config(text, str(file))
    if changes:
        write_atomic(file, text)
    for change in changes:
        click.echo(f"{file}: fixed: {change}")


def resolve(file: Path, kind: str, data: dict, world: int | None, o: dict) -> tuple[list[Resolved], list[Problem]]:
    """The "auto" values of the DeepSpeed file (FILE, or the one TrainingArguments name) as the Trainer fills them;
    for a DeepSpeed file given alone, also the batch values the Trainer, with the batch the flags give, would find
    mismatched and stop on (validate_file compares a TrainingArguments file's values itself)."""
    if kind == "deepspeed":
        config, trainer = data, TrainerValues()
    elif kind == "training_args" and isinstance(data.get("deepspeed"), str):
        wrong = TrainerValues.type_problems(data)
        if wrong:
            raise DistsetupError(
                f"--resolve: {file} has values of the wrong type ({', '.join(p.path for p in wrong)}).",
                "fix them first; `distsetup validate` without --resolve says how.",
            )
        config, trainer = read_json(resolve_config_path(data["deepspeed"], file.parent)), TrainerValues.from_dict(data)
    else:
        raise DistsetupError(
            f"--resolve needs a DeepSpeed file or TrainingArguments naming one; {file} is a {KIND_NAMES[kind]}.",
            "give the DeepSpeed JSON (with --hf).",
        )
    given = {
        "per_device_train_batch_size": o["micro_batch_size"],
        "gradient_accumulation_steps": o["gradient_accumulation_steps"],
        "max_steps": o["max_steps"],
    }
    trainer = replace(trainer, **{key: value for key, value in given.items() if value is not None})
    context = Context(world_size=world, hidden_size=o["hidden_size"])
    mismatched = []
    if kind == "deepspeed" and o["micro_batch_size"]:  # the batch the flags give (the other values are unknown)
        batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        mismatched = [p for p in mismatch_problems(config, trainer, context, str(file)) if p.path in batch_keys]
    return resolve_auto(config, trainer, context), mismatched

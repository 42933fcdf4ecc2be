"""`distsetup validate`: report every problem in a DeepSpeed, FSDP or run config file."""

from pathlib import Path

import click

from distsetup.cli.options import checked, option, world_options
from distsetup.formats.batch import world_size_from
from distsetup.formats.fsdp import reader_notes
from distsetup.formats.problems import as_json
from distsetup.formats.validate import KINDS, validate_file

KIND_NAMES = {"deepspeed": "DeepSpeed config", "fsdp": "FSDP config", "run_config": "run config"}


@click.command(
    epilog="""\b
Examples:
  distsetup validate config/ds_config.json --world_size 16
  distsetup validate config.yaml
  distsetup validate ds_hf.json --hf --json
"""
)
@click.argument("file", type=checked(click.Path(dir_okay=False, path_type=Path)))
@world_options
@option("hf", is_flag=True, help='The file is for the HF Trainer: "auto" values are allowed.')
@option("kind", type=click.Choice(KINDS), help="Override the detected kind of file.")
@click.option("--json", "as_json_output", is_flag=True, help="Print the problems as JSON.")
@click.pass_context
def validate(ctx: click.Context, file: Path, world_size, num_nodes, num_gpus_per_node, hf, kind, as_json_output):
    """Check FILE against the schema and DeepSpeed's and FSDP's cross-field rules; exit 1 on problems."""
    world = world_size_from(world_size, num_nodes, num_gpus_per_node)
    kind, problems, data = validate_file(file, kind, world, hf)
    if as_json_output:
        click.echo(as_json(problems))
    else:
        for problem in problems:
            click.echo(f"{file}: {problem}")
        if kind == "fsdp":
            for note in reader_notes(data):
                click.echo(f"{file}: note: {note}")
        checked = f" for world size {world}" if world else ""
        summary = f"{len(problems)} problem(s)" if problems else "no problems"
        click.echo(f"{file}: {KIND_NAMES[kind]}, {summary}{checked}.", err=bool(problems))
    ctx.exit(1 if problems else 0)

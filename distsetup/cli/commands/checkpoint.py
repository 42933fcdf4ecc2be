"""`distsetup checkpoint`: what a run's checkpoints hold, read from their folders without torch."""

import json
from pathlib import Path

import click

from distsetup.cli.options import checked, option
from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import checkpoints_folder, list_checkpoints
from distsetup.formats.runconfig import BACKENDS

COLUMNS = ("step", "backend", "ZeRO", "world", "precision", "complete", "size", "val loss", "")


@click.group(
    epilog="""\b
Examples:
  distsetup checkpoint ls runs/exp                 # runs/exp/checkpoints/step_*
  distsetup checkpoint ls runs/exp --json
  distsetup checkpoint export runs/exp -o exported/ --dtype bf16
  distsetup checkpoint export runs/llama -o exported/ --format hf    # from_pretrained("exported/")
  distsetup checkpoint convert runs/exp --to fsdp -o runs/exp-fsdp  # a ZeRO-3 run continues under FSDP2
"""
)
def checkpoint():
    """Inspect the checkpoints of a run."""


@checkpoint.command("ls")
@click.argument("run", type=checked(click.Path(file_okay=False, path_type=Path)))
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def ls(run: Path, as_json: bool):
    """List RUN's checkpoints (RUN: a training.output_dir, or its checkpoints folder): step, backend, ZeRO stage,
    world size, precision, whether it is complete and intact, its size, its validation loss (where the run evaluated
    at its step), the one a resumed run starts from and the best one (the lowest validation loss)."""
    folder = checkpoints_folder(run)
    if not folder.is_dir():
        raise DistsetupError(f"{run}: no such folder.", "give a run's training.output_dir (it holds checkpoints/).")
    listed = list_checkpoints(run)
    if as_json:
        click.echo(json.dumps([c.to_dict() for c in listed], indent=2))
        return
    if not listed:
        click.echo(f"{folder}: no checkpoints.")
        return
    rows = [COLUMNS] + [
        (
            str(c.step),
            c.backend or "?",
            "-" if c.zero_stage is None else str(c.zero_stage),
            "?" if c.world_size is None else str(c.world_size),
            c.precision or "?",
            "yes" if c.complete else f"no: {c.problem}",
            f"{c.size_bytes / 2**20:.1f} MiB",
            "-" if c.val_loss is None else f"{c.val_loss:.4f}",
            "<- " + ", ".join(mark for mark, on in (("resume", c.resume), ("best", c.best)) if on)
            if c.resume or c.best
            else "",
        )
        for c in listed
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    click.echo(f"{folder}:")
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


@checkpoint.command("export")
@click.argument("run", type=checked(click.Path(file_okay=False, path_type=Path)))
@click.option("-o", "--output", type=checked(click.Path(path_type=Path)), required=True, help="A new folder to write.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option(
    "--format",
    "layout",
    type=click.Choice(["safetensors", "hf"]),
    default="safetensors",
    show_default=True,
    help="safetensors: model.safetensors and model.json (any model); hf: a Hugging Face folder that "
    "from_pretrained loads (model.type hf).",
)
@option("max_shard_size", help="--format hf: shard above this size, as save_pretrained  [default: 50GB]")
@option(
    "hf_path",
    type=checked(click.Path(file_okay=False, path_type=Path)),
    help="--format hf: the model folder the run trained (its config.json and tokenizer), where it is now "
    "[the run's model.hf_path].",
)
def export(run: Path, output: Path, dtype: str, layout: str, max_shard_size: str | None, hf_path: Path | None):
    """Write the newest complete checkpoint of RUN (any backend, any world size; RUN may also name one of its
    checkpoints/step_N folders) into the new folder OUTPUT:
    model.safetensors and model.json (the model section of its run config), or with --format hf a Hugging Face
    folder (config.json, tokenizer files, weights sharded as save_pretrained shards them). Imports torch (and
    DeepSpeed for its checkpoints); reads one tensor at a time."""
    from distsetup.training.world import name_the_cpu_to_deepspeed  # torch: only this subcommand needs it

    name_the_cpu_to_deepspeed()
    from distsetup.training.checkpoint.export import export_hf, export_safetensors

    if layout == "hf":
        used, count = export_hf(run, output, dtype, max_shard_size or "50GB", hf_path)
    elif max_shard_size is not None or hf_path is not None:
        flag = "--max_shard_size shards" if max_shard_size is not None else "--hf_path names the model folder of"
        raise DistsetupError(f"{flag} a Hugging Face folder.", "add --format hf, or leave it out.")
    else:
        used, count = export_safetensors(run, output, dtype)
    click.echo(f"exported {count} tensors ({dtype}) from {used} to {output}")
    if layout == "safetensors" and json.loads((output / "model.json").read_text()).get("type") == "hf":
        click.echo(
            "note: a Hugging Face model: from_pretrained does not load this folder, --format hf writes one it does"
        )


@checkpoint.command("convert")
@click.argument("run", type=checked(click.Path(file_okay=False, path_type=Path)))
@click.option(
    "--to",
    "backend",
    type=click.Choice(BACKENDS),
    required=True,
    help="The backend that resumes the result (deepspeed: any ZeRO stage 1-3).",
)
@click.option(
    "-o", "--output", type=checked(click.Path(path_type=Path)), required=True, help="A new run folder to write."
)
def convert(run: Path, backend: str, output: Path):
    """Rewrite the newest complete checkpoint of RUN (or the step_N folder RUN names; any backend, any world size)
    as one that BACKEND resumes at any world size, with the whole training state: weights, AdamW moments and steps,
    scheduler, fp16 loss scale, data position.
    OUTPUT becomes a run folder (OUTPUT/checkpoints/step_N): set training.output_dir to it. RUN is only read.
    Imports torch (and DeepSpeed for its checkpoints)."""
    from distsetup.training.world import name_the_cpu_to_deepspeed  # torch: only this subcommand needs it

    name_the_cpu_to_deepspeed()
    from distsetup.training.checkpoint.convert import convert as convert_checkpoint

    used, written = convert_checkpoint(run, backend, output)
    click.echo(f"converted {used} for {backend} into {written}")

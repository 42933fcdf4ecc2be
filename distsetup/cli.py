"""The `distsetup` command group; each subcommand lives in distsetup/commands/."""

import click

from distsetup import __version__
from distsetup.commands.deepspeed import deepspeed
from distsetup.commands.fsdp import fsdp
from distsetup.commands.validate import validate


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             epilog="""\b
Quick start:
  distsetup deepspeed --zero_stage 2 --offload_optimizer --bf16 --output config/ds_config.json
  distsetup validate config/ds_config.json --world_size 16
Shell completion (bash): eval "$(_DISTSETUP_COMPLETE=bash_source distsetup)"
""")
@click.version_option(__version__, prog_name="distsetup")
def cli():
    """Configs, launchers and SLURM scripts for distributed PyTorch training."""


for command in (deepspeed, fsdp, validate):
    cli.add_command(command)


def main():
    cli(prog_name="distsetup")

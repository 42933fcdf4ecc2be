"""The `distsetup` command group; each subcommand lives in distsetup/cli/commands/ and is imported only
when it runs (or when help lists it), so every command answers in a blink."""

import importlib
import sys

import click

from distsetup import __version__
from distsetup.errors import DistsetupError, refuse_arguments_not_in_utf8

# command name -> "module:function" under distsetup.cli.commands
COMMANDS = {
    "init": "init:init",
    "deepspeed": "deepspeed:deepspeed",
    "fsdp": "fsdp:fsdp",
    "validate": "validate:validate",
    "launcher": "launcher:launcher",
    "slurm": "slurm:slurm",
    "job": "job:job",
    "plan": "plan:plan_command",
    "status": "status:status",
    "doctor": "doctor:doctor",
    "checkpoint": "checkpoint:checkpoint",
}


class LazyGroup(click.Group):
    """A group that imports a subcommand's module on first use, and shows a user's error in one line on stderr:
    distsetup's own with exit status 1, Click's refusal of a flag or an argument (unknown, missing, of the wrong
    type) with its status 2, naming the --help that says what the command takes instead of printing its usage."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            raise in_one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DistsetupError as e:
            raise click.ClickException(e.format_message()) from None
        except click.UsageError as e:
            raise in_one_line(e) from None

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(f"distsetup.cli.commands.{module}"), attr)


def in_one_line(error: click.UsageError) -> click.UsageError:
    """Click's refusal without the usage lines it shows before it (the context left out), naming the --help to
    read."""
    if error.ctx is None:
        return error
    said = error.format_message().rstrip(".")
    ended = said if said.endswith(("?", "!", ")")) else f"{said}."  # "(Did you mean '--x'?)" ends its sentence
    return click.UsageError(f"{ended} HINT: `{error.ctx.command_path} --help` says what it takes.")


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    epilog="""\b
Quick start:
  distsetup init                                  # asks, then writes every file a run needs
  distsetup deepspeed --zero_stage 2 --offload_optimizer --bf16 --output config/ds_config.json
  distsetup validate config/ds_config.json --world_size 16
Shell completion (bash): eval "$(_DISTSETUP_COMPLETE=bash_source distsetup)"
""",
)
@click.version_option(__version__, prog_name="distsetup")
def cli():
    """Configs, launchers and SLURM scripts for distributed PyTorch training."""


def main():
    try:
        refuse_arguments_not_in_utf8(sys.argv[1:])
    except DistsetupError as e:
        click.echo(f"Error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    cli(prog_name="distsetup")

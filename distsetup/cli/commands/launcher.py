"""`distsetup launcher`: write scripts/run_training.sh, which starts one world on this node (or one node of many)."""

import shlex

import click

from distsetup.cli.launch_options import (
    launch_inputs,
    launch_options,
    regenerate_command,
    script_notes,
)
from distsetup.cli.launch_spec import launch_spec_from_options
from distsetup.cli.options import option, renamed, take_renamed
from distsetup.cli.output import emit
from distsetup.formats.default_paths import SCRIPTS
from distsetup.scripts.launch_plan import RDZV_BACKENDS, build_launcher_script, launch_warnings


@click.command(
    epilog="""\b
Examples:
  distsetup launcher --config config.yaml --num_gpus_per_node 4 --use_deepspeed
  distsetup launcher --use_deepspeed --deepspeed_config config/ds_config.json --num_gpus_per_node 2
  distsetup launcher --config config.yaml --num_nodes 2 --num_gpus_per_node 8 \\
      --master_addr 10.1.2.3 --master_port 29500 --node_rank 1          # one script per node
  distsetup launcher --use_fsdp --gpus 2,3 --preflight -o scripts/run_fsdp.sh
  distsetup launcher --python_module mypkg.train --num_gpus_per_node 2   # your own module
  distsetup launcher --script my_train.py --num_gpus_per_node 2          # your own script
"""
)
@launch_options
@renamed("module", "python_module")
@option("node_rank", type=int, help="This node's rank; without it the script reads NODE_RANK at run time.")
@option("master_addr", help="Address of node 0 [127.0.0.1 on one node; on several, MASTER_ADDR at run time].")
@option(
    "rdzv_backend",
    type=click.Choice(RDZV_BACKENDS),
    default="static",
    show_default=True,
    help="torchrun rendezvous: static (--node_rank) or c10d (elastic; ranks assigned on joining).",
)
@option("rdzv_id", default="distsetup", show_default=True, help="Rendezvous id for c10d (same on every node).")
@option("hosts", help="Comma-separated node names for the deepspeed launcher's hostfile.")
@option("ssh", is_flag=True, help="Deepspeed launcher over pdsh/ssh from node 0 (default: --no_ssh per node).")
@option("gpus", help="GPUs to use: 0,1 (CUDA_VISIBLE_DEVICES) or auto:N (N with most free memory now).")
@option(
    "output",
    "-o",
    type=click.Path(dir_okay=False),
    default=SCRIPTS["local"],
    show_default=True,
    help="Script to write; '-' prints it.",
)
def launcher(output, dry_run, **opts):
    """Write a launch script (torchrun, deepspeed or accelerate) for one node of a training world.

    It runs distsetup's trainer (python -m distsetup.train) unless --script or --python_module names your own,
    and works from any folder: it first enters the folder it was written in, which relative paths refer to.
    """
    take_renamed(opts, "module", "python_module")
    spec, notes = launch_spec_from_options(opts)
    run_command = f"bash {shlex.quote(str(output))}"
    notes += script_notes(spec, run_command)
    text = build_launcher_script(spec, command_line=regenerate_command("launcher"), output=output)
    remarks = [f"Note: {note}" for note in notes] + [f"Warning: {w}" for w in launch_warnings(spec, run_command)]
    emit(text, output, dry_run, next_step=run_command, executable=True, inputs=launch_inputs(spec), remarks=remarks)

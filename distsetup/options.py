"""Options shared by several commands, each spelled --snake_case (as guides write it) and --dash-case."""

import click


def option(name: str, *extra_decls: str, **kwargs):
    """`--name` and `--na-me` for one Click option."""
    dashed = name.replace("_", "-")
    decls = [f"--{name}", *([f"--{dashed}"] if dashed != name else []), *extra_decls]
    return click.option(*decls, name, **kwargs)


def switch(name: str, **kwargs):
    """A boolean option with its negation: --name/--no_name, in both spellings."""
    dashed = name.replace("_", "-")
    decls = [f"--{name}/--no_{name}", *([f"--{dashed}/--no-{dashed}"] if dashed != name else [])]
    return click.option(*decls, name, **kwargs)


def stack(*decorators):
    """Apply several option decorators as one."""
    def apply(func):
        for decorator in reversed(decorators):
            func = decorator(func)
        return func
    return apply


positive = click.IntRange(min=1)

output_options = stack(
    option("output", "-o", type=click.Path(dir_okay=False), default=None,
           help="File to write; '-' or nothing prints to stdout."),
    option("dry_run", is_flag=True, help="Print what would be written and write nothing."),
)

world_options = stack(
    option("world_size", type=positive, help="Data-parallel processes in total."),
    option("num_nodes", type=positive, help="Nodes; world size = nodes x GPUs per node."),
    option("num_gpus_per_node", type=positive, help="Processes (GPUs) per node."),
)

batch_options = stack(
    option("micro_batch_size", type=positive, help="Samples per GPU per forward pass."),
    option("gradient_accumulation_steps", type=positive, help="Micro-batches per optimizer step."),
    option("train_batch_size", type=positive,
           help="Global batch = micro x accumulation x world size; any two give the third."),
)

"""Options shared by several commands, each spelled --snake_case (as guides write it) and --dash-case.

Every option made here takes its value through `Checked`: a value that names something is never empty,
a number is finite (distsetup's rules: a DistsetupError, exit 1), and a value of another type or range (Click's
rules) is one line naming the flag with a usage error's exit status 2, not Click's usage block.
"""

import dataclasses
import math

import click

from distsetup.errors import DistsetupError


def flag_of(param) -> str:
    """How the user spelled a parameter: --name for an option, NAME for an argument."""
    longs = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
    return longs[0] if longs else param.human_readable_name if param is not None else "a value"


class Checked(click.ParamType):
    """A Click type with the rules every option follows: empty or blank text is refused (it would be read
    as "not given", or write MASTER_ADDR=''), NaN and infinities are refused (they reach JSON as NaN), and
    the wrapped type's own failures are one line naming the flag."""

    def __init__(self, inner: click.ParamType):
        self.inner = inner
        self.name = inner.name
        # Click declares these on the class; a wrapper of a tuple type must answer as the tuple does.
        self.is_composite, self.arity = inner.is_composite, inner.arity  # type: ignore[misc]
        self.envvar_list_splitter = inner.envvar_list_splitter  # type: ignore[misc]

    def convert(self, value, param, ctx):
        flag = flag_of(param)
        if isinstance(value, str) and not value.strip():
            required = param is not None and param.required
            raise DistsetupError(
                f"{flag} is empty.", "give a value." if required else f"give a value, or leave {flag} out."
            )
        try:
            result = self.inner.convert(value, param, ctx)
        except click.BadParameter as e:  # a usage error, Click's exit status 2: said in one line (cli.main)
            raise click.UsageError(f"{flag}: {e.message}", ctx) from None
        for number in result if isinstance(result, tuple) else (result,):
            if isinstance(number, float) and not math.isfinite(number):
                raise DistsetupError(f"{flag}: {number} is not a finite number.", "give a number such as 0.5.")
        return result

    def get_metavar(self, *args, **kwargs):
        return self.inner.get_metavar(*args, **kwargs)

    def get_missing_message(self, *args, **kwargs):
        return self.inner.get_missing_message(*args, **kwargs)

    def shell_complete(self, ctx, param, incomplete):
        return self.inner.shell_complete(ctx, param, incomplete)

    def to_info_dict(self):
        return self.inner.to_info_dict()


def checked(type_=None, default=None) -> Checked:
    """`type_` (a Click type, a Python type, a tuple of them, or None for text) under the rules of Checked."""
    return type_ if isinstance(type_, Checked) else Checked(click.types.convert_type(type_, default))


def option(name: str, *extra_decls: str, **kwargs):
    """`--name` and `--na-me` for one Click option; a valued option's type goes through `checked`."""
    dashed = name.replace("_", "-")
    decls = [f"--{name}", *([f"--{dashed}"] if dashed != name else []), *extra_decls]
    is_flag = kwargs.get("is_flag", "flag_value" in kwargs)
    if not is_flag:
        default = kwargs.get("default")
        kwargs["type"] = checked(kwargs.get("type"), default[0] if kwargs.get("multiple") and default else default)
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


def chosen_precision(bf16: bool, fp16: bool, fp32: bool = False) -> str | None:
    """The precision flag given (bf16, fp16 or fp32), None for none; two of them are an error."""
    given = [name for name, on in (("bf16", bf16), ("fp16", fp16), ("fp32", fp32)) if on]
    if len(given) > 1:
        raise DistsetupError(f"--{' and --'.join(given)} are mutually exclusive.", "choose one (bf16 on A100/H100).")
    return given[0] if given else None


def spec_values(spec_class, opts: dict, *, besides: tuple[str, ...] = ()) -> dict:
    """The fields of a spec dataclass that options of the same name give, but those in `besides` (the command
    builds them itself): {field: its option's value}."""
    return {f.name: opts[f.name] for f in dataclasses.fields(spec_class) if f.name in opts and f.name not in besides}


class IntegerRange(click.IntRange):
    """click.IntRange, saying what it takes: "'two' is not a valid integer" and INTEGER in --help, where Click says
    "integer range"."""

    name = "integer"


class NumberRange(click.FloatRange):
    """click.FloatRange, as IntegerRange: "'x' is not a valid float", FLOAT in --help."""

    name = "float"


positive = IntegerRange(min=1)

output_options = stack(
    option(
        "output",
        "-o",
        type=click.Path(dir_okay=False),
        default=None,
        help="File to write (its missing folders are made); '-' or nothing prints to stdout.",
    ),
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
    option(
        "train_batch_size",
        type=positive,
        help="Global batch = micro x accumulation x world size; any two give the third.",
    ),
)


class RenamedOption(click.Option):
    """An option's old spelling, kept for one release: hidden from --help, the same meaning as before, and one
    line on stderr naming the flag that replaces it."""

    def __init__(self, *args, new_flag: str, **kwargs):
        kwargs["hidden"] = True
        super().__init__(*args, **kwargs)
        self.new_flag = new_flag

    def handle_parse_result(self, ctx, opts, args):
        value, args = super().handle_parse_result(ctx, opts, args)
        if ctx.get_parameter_source(self.name) is click.core.ParameterSource.COMMANDLINE:
            click.echo(
                f"Warning: `{ctx.info_name} {self.opts[0]}` is deprecated and goes in the next release: "
                f"use {self.new_flag} (same meaning).",
                err=True,
            )
        return value, args


def renamed(old: str, new: str, **kwargs):
    """--old as a deprecated spelling of --new (a separate parameter named `old`; the command folds it in with
    `take_renamed`)."""
    return option(old, cls=RenamedOption, new_flag=f"--{new}", **kwargs)


def take_renamed(opts: dict, old: str, new: str) -> None:
    """Fold the value of a renamed option's old spelling into the new one; both given is an error."""
    value = opts.pop(old)
    if value and opts[new]:
        raise DistsetupError(f"--{old} is the old spelling of --{new}; give one of them.", f"use --{new}.")
    if value:
        opts[new] = value

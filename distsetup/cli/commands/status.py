"""`distsetup status`: every NVIDIA GPU through NVML and which ones pass selection."""

import json

import click

from distsetup.cli.options import NumberRange, option, positive
from distsetup.errors import DistsetupError
from distsetup.formats.batch import FLAGS, BatchMismatch, complete_batch
from distsetup.formats.lr_scaling import SCALING_RULES, scaled_lr
from distsetup.planning.gpus import GIB, NoGpuError, choose_gpus, judge_gpus, query_gpus


@click.command(
    "status",
    epilog="""\b
Examples:
  distsetup status
  distsetup status --min_free_gb 40 --max_util 10 --json
  distsetup status --count 8 --allow_fewer --global_batch_size 256 --micro_batch_size 4 --lr 3e-4 --scale_lr linear
""",
)
@option(
    "min_free_gb",
    type=NumberRange(min=0),
    default=16,
    show_default=True,
    help="A GPU qualifies with at least this much free memory (GiB).",
)
@option(
    "max_util",
    type=NumberRange(0, 100),
    default=90,
    show_default=True,
    help="... and utilisation under this (percent).",
)
@option("count", type=positive, help="GPUs wanted (as in `launcher --gpus auto:N`): error when fewer qualify.")
@option("allow_fewer", is_flag=True, help="With --count: take fewer GPUs and redo the batch arithmetic.")
@option("global_batch_size", type=positive, help="With --allow_fewer: the global batch to keep.")
@option("micro_batch_size", type=positive, help="With --allow_fewer: samples per GPU per pass.")
@option("lr", type=NumberRange(min=0, min_open=True), help="With --scale_lr: the lr at --base_batch_size.")
@option("scale_lr", type=click.Choice(SCALING_RULES), help="Rescale --lr if the global batch changes.")
@click.option("--json", "as_json", is_flag=True, help="Print GPUs and the selection as JSON.")
def status(min_free_gb, max_util, count, allow_fewer, global_batch_size, micro_batch_size, lr, scale_lr, as_json):
    """List NVIDIA GPUs (memory, utilisation, processes) and which pass selection, ranked by free memory."""
    needs_count = {
        "--allow_fewer": allow_fewer,
        "--global_batch_size": global_batch_size,
        "--micro_batch_size": micro_batch_size,
        "--lr": lr,
        "--scale_lr": scale_lr,
    }
    given = [flag for flag, value in needs_count.items() if value]
    if given and count is None:
        raise DistsetupError(
            f"{given[0]} works with --count: it redoes the batch arithmetic for the GPUs "
            "selected out of --count asked for.",
            f"add --count N, or drop {given[0]}.",
        )
    if scale_lr and lr is None:
        raise DistsetupError("--scale_lr needs --lr, the learning rate to rescale.", "add --lr, or drop --scale_lr.")
    try:
        gpus = query_gpus()
    except NoGpuError as e:
        if count:  # GPUs asked for: none qualify, an error as where too few do (`status --count 8 && launch`)
            raise
        click.echo(f"{json.dumps({'gpus': [], 'message': e.message})}" if as_json else e.message)
        return
    verdicts = judge_gpus(gpus, min_free_gb, max_util)
    chosen = (
        choose_gpus(gpus, count, min_free_gb, max_util, allow_fewer)
        if count
        else [v.gpu.index for v in verdicts if v.ok]
    )
    batch = refit_batch(count, len(chosen), global_batch_size, micro_batch_size, lr, scale_lr) if count else None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "gpus": [{**v.gpu.to_dict(), "qualifies": v.ok, "reason": v.reason} for v in verdicts],
                    "selected": chosen,
                    "batch": batch,
                },
                indent=2,
            )
        )
        return
    click.echo(f"{'GPU':>3}  {'name':<24} {'used':>8} {'free':>8} {'total':>8} {'util':>5}  {'ok':<3} processes")
    for v in sorted(verdicts, key=lambda v: v.gpu.index):
        g = v.gpu
        procs = ", ".join(f"{p.pid} {p.name}" for p in g.processes) or "-"
        util = f"{g.utilization}%" if g.utilization is not None else "?"
        click.echo(
            f"{g.index:>3}  {g.name[:24]:<24} {g.memory_used / GIB:7.1f}G {g.memory_free / GIB:7.1f}G "
            f"{g.memory_total / GIB:7.1f}G {util:>5}  {'yes' if v.ok else 'no':<3} {procs}"
            + ("" if v.ok else f"  ({v.reason})")
        )
    order = ",".join(map(str, chosen)) or "none"
    click.echo(f"Selected (free >= {min_free_gb:g} GiB, util < {max_util:g}%, most free first): {order}")
    if chosen:
        click.echo(f"Use: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={','.join(map(str, chosen))}")
    if batch and batch["note"]:
        click.echo(batch["note"])


def refit_batch(
    asked: int, got: int, global_batch: int | None, micro: int | None, lr: float | None, rule: str | None
) -> dict | None:
    """With fewer GPUs than asked: keep the global batch through more accumulation, or rescale the lr."""
    if global_batch is None and micro is None:
        return {"world_size": got, "note": f"Using {got} of the {asked} GPUs asked for." if got < asked else ""}
    micro = micro or 1
    global_batch = global_batch or micro * asked
    try:  # the accumulation that keeps the global batch on `got` GPUs: formats/batch.py's arithmetic
        accumulation = complete_batch(micro, None, global_batch, got, FLAGS).accumulation
    except BatchMismatch as e:  # none does: the nearest global batch the micro-batch gives on `got` GPUs
        accumulation, nearest = e.fits // (micro * got), e.fits
    else:
        note = (
            f"Using {got} of {asked} GPUs: gradient accumulation {accumulation} keeps the global batch "
            f"{global_batch} (micro-batch {micro} x {accumulation} x {got}); the lr stays as it is."
        )
        return {
            "world_size": got,
            "micro_batch_size": micro,
            "gradient_accumulation_steps": accumulation,
            "global_batch_size": global_batch,
            "lr": lr,
            "note": note if got < asked else "",
        }
    new_global, new_lr = nearest, None
    if lr is not None:
        if rule is None:
            raise DistsetupError(
                f"with {got} GPUs the global batch {global_batch} cannot be kept "
                f"(nearest: {new_global}); the lr would need rescaling.",
                "add --scale_lr linear (or sqrt), or choose a micro-batch that divides it.",
            )
        new_lr = scaled_lr(lr, new_global, global_batch, rule)
    note = (
        f"Using {got} of {asked} GPUs: global batch {global_batch} -> {new_global} (micro-batch {micro} x "
        f"accumulation {accumulation} x {got})"
        + (f"; lr {lr:g} -> {new_lr:.6g} ({rule} scaling)." if new_lr is not None else ".")
    )
    return {
        "world_size": got,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "global_batch_size": new_global,
        "lr": new_lr,
        "note": note,
    }

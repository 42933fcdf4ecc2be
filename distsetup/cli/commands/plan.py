"""`distsetup plan`: per-GPU memory of every strategy, and the fastest one that fits."""

import json
import shlex
from dataclasses import replace
from pathlib import Path

import click

from distsetup.cli.options import IntegerRange, NumberRange, chosen_precision, option, positive, switch
from distsetup.cli.output import check_replaced_kind, json_text, writable_target, write_atomic
from distsetup.cli.plan_model import model_from_options
from distsetup.errors import DistsetupError
from distsetup.formats.batch import check_world_counts, global_batch_of
from distsetup.formats.default_paths import BACKEND_FILE_NAMES, CONFIG_FOLDER
from distsetup.formats.runconfig import BUILTIN_BLOCK, MODEL_MAXIMA
from distsetup.planning.estimates import BY_KEY, Hardware, Workload
from distsetup.planning.models import ModelShape
from distsetup.planning.planner import Plan, plan
from distsetup.planning.recommendation import recommended_files
from distsetup.planning.units import MAX_BATCH, gb, in_words, parse_memory

COLUMNS = (
    "strategy",
    "params",
    "grads",
    "optim",
    "gathered",
    "buffers",
    "act",
    "act(ckpt)",
    "total",
    "CPU/node",
    "set-up r0/rank",
    "comm",
    "fits",
)


@click.command(
    "plan",
    epilog="""\b
Examples:
  distsetup plan --params 7B --num_gpus 8 --gpu_memory 80GB --seq_len 4096 --micro_batch_size 2 --bf16 \\
      --hidden_size 4096 --num_layers 32 --vocab_size 32000
  distsetup plan --config config.yaml --num_nodes 4 --num_gpus_per_node 8 --gpu_memory 80GB --write config/
Memory in decimal GB (1e9 bytes). Model states follow the ZeRO paper (K=12 for mixed-precision Adam)
plus what DeepSpeed and FSDP really allocate; activations follow Korthikanti et al. 2022.
""",
)
@option("params", help="Parameter count, e.g. 7B, 350M (or give --config).")
@option("config", type=click.Path(dir_okay=False, exists=True), help="Run config: the model is counted from it.")
@option(
    "hidden_size",
    type=IntegerRange(1, MODEL_MAXIMA["n_embd"]),
    help="Hidden size (for activations and ZeRO's buffers).",
)
@option("num_layers", type=IntegerRange(1, MODEL_MAXIMA["n_layer"]), help="Transformer layers (for activations).")
@option(
    "num_heads", type=IntegerRange(1, MODEL_MAXIMA["n_head"]), help="Attention heads (only without flash attention)."
)
@option("vocab_size", type=IntegerRange(1, MODEL_MAXIMA["vocab_size"]), help="Vocabulary size (for the logits).")
@option("layer_cls", help="Your model's decoder-layer class, for FSDP wrapping (e.g. LlamaDecoderLayer).")
@option("num_gpus", type=positive, help="GPUs in total (spread over --num_nodes).")
@option("num_nodes", type=positive, help="Nodes [1; with --num_gpus and --num_gpus_per_node, their quotient].")
@option("num_gpus_per_node", type=positive, help="GPUs per node.")
@option("gpu_memory", help="Memory per GPU, e.g. 80GB or 24GiB [this machine's smallest GPU].")
@option("cpu_memory", help="CPU memory per node (offload, the model built at set-up), e.g. 512GB [not judged].")
@option("headroom", type=NumberRange(0, 0.9), default=0.1, show_default=True, help="Fraction of GPU memory kept free.")
@option(
    "seq_len",
    type=IntegerRange(1, MODEL_MAXIMA["block_size"]),
    help="Tokens per sample [model.block_size, else 2048].",
)
@option("micro_batch_size", type=IntegerRange(1, MAX_BATCH), help="Samples per GPU per pass [the largest that fits].")
@option(
    "global_batch_size", type=IntegerRange(1, MAX_BATCH), help="Samples per optimizer step [run config's, else none]."
)
@option("bf16", is_flag=True, help="bfloat16 mixed precision.")
@option("fp16", is_flag=True, help="float16 mixed precision.")
@option("fp32", is_flag=True, help="fp32 training [default without a config].")
@switch(
    "flash_attention",
    default=True,
    show_default=True,
    help="Fused attention (SDPA/flash): no s^2 attention scores kept.",
)
@option("strategy", multiple=True, type=click.Choice(list(BY_KEY)), help="Only consider these strategies (repeatable).")
@option("write", type=click.Path(file_okay=False), help="Write the recommended DeepSpeed/FSDP config here.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_command(**o):
    """Estimate per-GPU memory for DDP, ZeRO 1-3 (+offload) and FSDP, and recommend the fastest that fits."""
    hw = hardware_from_options(o)  # first: a missing GPU is said before the model is counted (seconds, with torch)
    model, defaults, notes = model_from_options(o)
    precision = chosen_precision(o["bf16"], o["fp16"], o["fp32"]) or defaults.get("precision", "fp32")
    global_batch = o["global_batch_size"] or (
        global_batch_of(defaults["micro_batch"], defaults["accumulation"], hw.world_size)
        if "micro_batch" in defaults
        else None
    )
    if global_batch is not None and global_batch > MAX_BATCH:
        raise DistsetupError(
            f"the run config's global batch {global_batch:,} is more than {MAX_BATCH:,} samples.",
            "give --global_batch_size, or lower training.micro_batch_size.",
        )
    # the run config's micro-batch, which the file written must agree with (the launcher refuses another); not
    # beside --global_batch_size, which asks for another batch
    run_configs_micro_batch = None if o["global_batch_size"] else defaults.get("micro_batch")
    work = Workload(
        precision=precision,
        seq_len=o["seq_len"] or defaults.get("seq_len", 2048),
        micro_batch_size=o["micro_batch_size"] or run_configs_micro_batch,
        global_batch_size=global_batch,
        flash_attention=o["flash_attention"],
        chunked_loss=defaults.get("chunked_loss", "auto"),
    )
    result = plan(model, hw, work, tuple(o["strategy"]) or None)
    if result.choice is None and run_configs_micro_batch and not o["micro_batch_size"]:
        result.advice.insert(0, _what_the_run_config_could_take(model, hw, work, tuple(o["strategy"]) or None))
    folder = str(Path(o["write"])) if o["write"] else CONFIG_FOLDER  # the Next command writes what --write wrote
    command, files, warnings = recommended_files(result, defaults.get("optimizer"), folder)
    for note in notes:  # after every check: a note never precedes an error
        click.echo(f"Note: {note}", err=True)
    for warning in warnings:  # what the recommended command says of its file (HYBRID_SHARD under FSDP2, say)
        click.echo(f"Warning: {warning}", err=True)
    if o["params"] and not o["layer_cls"] and BACKEND_FILE_NAMES["fsdp"] in files:
        click.echo(
            f"Note: the FSDP command wraps the built-in model's {BUILTIN_BLOCK} class; give --layer_cls with your "
            "model's decoder layer (e.g. LlamaDecoderLayer).",
            err=True,
        )
    if o["as_json"]:
        click.echo(json.dumps({**result.to_dict(), "command": command}, indent=2))
    else:
        click.echo(render_table(result, command, o["config"]))
    if o["write"]:
        if not files:
            click.echo(
                "Nothing to write: "
                + ("DDP needs no DeepSpeed or FSDP file." if result.choice else "no strategy fits."),
                err=True,
            )
        for name, config in files.items():
            path = Path(o["write"]) / name
            inputs = {"run config": o["config"]}
            kind = next(backend for backend, its_name in BACKEND_FILE_NAMES.items() if its_name == name)
            check_replaced_kind(writable_target(path, inputs, "--write"), kind, "--write")
            write_atomic(path, json_text(config), inputs=inputs, option="--write")
            click.echo(f"Wrote {path}", err=True)


def hardware_from_options(o: dict) -> Hardware:
    per_node = o["num_gpus_per_node"]
    nodes = o["num_nodes"] or 1
    if o["num_gpus"] and per_node and o["num_nodes"] is None:  # the nodes they fill
        if o["num_gpus"] % per_node:
            raise DistsetupError(
                f"--num_gpus {o['num_gpus']} does not fill whole nodes of --num_gpus_per_node {per_node}.",
                f"give a multiple of {per_node}, or --num_nodes with --num_gpus_per_node.",
            )
        nodes = o["num_gpus"] // per_node
    if o["num_gpus"]:
        if o["num_gpus"] % nodes or (per_node and per_node * nodes != o["num_gpus"]):
            raise DistsetupError(
                f"--num_gpus {o['num_gpus']} does not match --num_nodes {nodes}"
                + (f" x --num_gpus_per_node {per_node}" if per_node else "")
                + ".",
                "give --num_gpus, or --num_nodes with --num_gpus_per_node.",
            )
        per_node = o["num_gpus"] // nodes
    check_world_counts(
        nodes, per_node, per_node_flag="--num_gpus / --num_nodes =" if o["num_gpus"] else "--num_gpus_per_node"
    )
    if o["gpu_memory"]:
        memory = parse_memory(o["gpu_memory"])
    else:
        from distsetup.planning.gpus import NoGpuError, query_gpus

        try:
            gpus = query_gpus()
        except NoGpuError as e:  # planning for GPUs elsewhere, from a laptop or a login node, is the common case
            hint = "give --gpu_memory (e.g. 80GB) to plan for the GPUs the run will use."
            raise DistsetupError(e.problem, hint) from None
        memory = min(g.memory_total for g in gpus)
        per_node = per_node or len(gpus)
    return Hardware(
        num_nodes=nodes,
        gpus_per_node=per_node or 1,
        gpu_memory=memory,
        cpu_memory=parse_memory(o["cpu_memory"], "--cpu_memory") if o["cpu_memory"] else None,
        headroom=o["headroom"],
    )


def _what_the_run_config_could_take(model: ModelShape, hw: Hardware, work: Workload, allowed) -> str:
    """Where the run config's micro-batch fits no strategy: the one that fits a micro-batch the planner picks."""
    free = plan(model, hw, replace(work, micro_batch_size=None), allowed)
    said = f"training.micro_batch_size {work.micro_batch_size} (the run config's) fits no strategy"
    if free.choice is None:
        return f"{said}, nor does a smaller one."
    recompute = " with activation checkpointing" if free.choice.activation_checkpointing else ""
    return (
        f"{said}: {free.choice.label}{recompute} fits micro-batch {free.micro_batch} (gradient accumulation "
        f"{free.accumulation}); set them in the run config and plan again."
    )


def render_table(result: Plan, command: str | None, run_config: str | None = None) -> str:
    """The plan as a table, its recommendation and the next command (`run_config`: plan's --config, which the
    launcher then takes too)."""
    hw, work, model = result.hardware, result.workload, result.model
    sequence = f", sequence {work.seq_len}" if model.hidden_size else ""  # a python model's activations: uncounted
    lines = [
        f"Model: {in_words(model.params)} parameters; {hw.num_nodes} node(s) x {hw.gpus_per_node} GPU(s) of "
        f"{gb(hw.gpu_memory)} GB ({gb(hw.gpu_memory * (1 - hw.headroom))} GB usable); {work.precision}"
        f"{sequence}. GB per GPU at micro-batch {result.estimates[0].micro_batch}:"
    ]
    rows = [COLUMNS]
    for e in result.estimates:
        fits_ac = replace(e, activation_checkpointing=True)
        if not e.host_fits:
            verdict = "no (CPU)"
        else:
            verdict = "yes" if e.total <= e.usable else ("with ckpt" if fits_ac.total <= e.usable else "no")
        rows.append(
            (
                e.label,
                gb(e.params),
                gb(e.grads + e.fp32_grads),
                gb(e.optimizer),
                gb(e.gathered),
                gb(e.buffers),
                gb(e.activations),
                gb(e.activations_checkpointed),
                gb(e.total),
                gb(e.cpu_per_node) if e.cpu_per_node else "-",
                f"{gb(e.setup_rank0)}/{gb(e.setup_others)}",
                f"{e.comm_vs_ddp:g}x",
                verdict,
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(COLUMNS))]
    for row in rows:
        cells = (
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        lines.append("  ".join(cells))
    lines.append(
        "total: the peak, at the end of forward (the activations, autocast's 16-bit weights, and gradients only where "
        "they outlive a step or accumulate) or in the optimizer step (every state), plus gathered and buffers. "
        "CPU/node and set-up r0/rank are host memory: the node's offloaded state, and what rank 0 and each other "
        "rank take at set-up (rank 0 alone builds the model whole); fits 'no (CPU)': --cpu_memory does not hold them."
    )
    choice = result.choice
    if choice is None:
        lines.append("Nothing fits. What would:")
        lines += [f"  - {a}" for a in result.advice]
        return "\n".join(lines)
    ckpt = " with activation checkpointing" if choice.activation_checkpointing else ""
    lines.append(
        f"Recommended: {choice.label}{ckpt}, micro-batch {result.micro_batch}, gradient accumulation "
        f"{result.accumulation} (global batch {result.global_batch}): {gb(choice.total)} GB of "
        f"{gb(choice.usable)} GB usable per GPU"
        + (f", {gb(choice.cpu_per_node)} GB CPU memory per node" if choice.cpu_per_node else "")
        + "."
    )
    lines += [f"Note: {a}" for a in result.advice]
    if choice.activation_checkpointing:
        lines.append(
            "Set training.activation_checkpointing: full in the run config "
            "(the HF Trainer: gradient_checkpointing=True)."
        )
    lines.append(
        f"Next: {command}"
        if command
        else "Next: distsetup launcher "
        + (f"--config {shlex.quote(run_config)} " if run_config else "")
        + f"--num_nodes {hw.num_nodes} --num_gpus_per_node {hw.gpus_per_node} (backend ddp needs no DeepSpeed or FSDP "
        "file)."
    )
    return "\n".join(lines)

"""What `distsetup init` writes from its answers: the run config, the DeepSpeed or FSDP file the planner
recommends, and the launcher or sbatch script. Everything is built, and checked as `distsetup validate`
checks it, in memory: `write_setup` then writes all of it or nothing."""

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from distsetup.cli.launch_options import venv_warnings
from distsetup.cli.output import json_text, refuse_generated_problems, write_atomic
from distsetup.errors import DistsetupError
from distsetup.formats.batch import check_world_counts, per_rank_batch
from distsetup.formats.deepspeed_rules import deepspeed_problems
from distsetup.formats.default_paths import CONFIG_FOLDER, RUN_CONFIG, SCRIPTS
from distsetup.formats.fsdp import TRAINER_PRECISIONS
from distsetup.formats.fsdp_rules import fsdp_problems
from distsetup.formats.runconfig import TrainingConfig
from distsetup.formats.runconfig_load import config_problems
from distsetup.planning.estimates import BY_KEY, STRATEGIES, Hardware, Workload, estimate
from distsetup.planning.models import BUILTIN_SIZES, ModelShape, hf_context_length, hf_shape_from_json
from distsetup.planning.planner import Plan, candidates, plan
from distsetup.planning.recommendation import recommended_files, run_config_optimizer
from distsetup.planning.units import gb, in_words, parse_memory
from distsetup.scripts.launch_plan import LaunchSpec, build_launcher_script, launch_warnings
from distsetup.scripts.sbatch import SlurmSpec, build_slurm_script, slurm_warnings

SCHEDULERS = tuple(SCRIPTS)
CPU_MICRO_BATCH = 8  # the largest micro-batch init gives a CPU process
LONGEST_DEFAULT_SEQUENCE = 2048  # an HF model's sequence unless --seq_len: its context, at most this


@dataclass(frozen=True)
class Answers:
    """Every answer of `distsetup init`, from a flag, the terminal or a default."""

    model: str  # a built-in size or a local Hugging Face model folder
    data: tuple[str, ...]  # training files; () is the synthetic task
    scheduler: str  # local | slurm
    num_nodes: int
    num_gpus_per_node: int  # GPUs, or CPU processes where gpu_memory is None
    gpu_memory: str | None  # memory of one GPU ("80GB"); None: a CPU setup
    precision: str
    global_batch_size: int
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    venv: str | None = None
    cpus_per_task: int | None = None
    max_steps: int = 1000
    seq_len: int | None = None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node

    def command_line(self) -> str:
        """`distsetup init --yes ...` that writes the same files again: without --force, so that run again where they
        are (after an edit by hand) it refuses rather than overwrite them."""
        words = ["distsetup", "init", "--yes", "--model", self.model]
        words += ["--data", ",".join(self.data) or "synthetic", "--scheduler", self.scheduler]
        words += ["--num_nodes", str(self.num_nodes), "--num_gpus_per_node", str(self.num_gpus_per_node)]
        words += ["--gpu_memory", self.gpu_memory or "none", "--precision", self.precision]
        words += ["--global_batch_size", str(self.global_batch_size), "--max_steps", str(self.max_steps)]
        for name in ("partition", "time_limit", "account", "venv", "cpus_per_task", "seq_len"):
            if getattr(self, name) is not None:
                words += [f"--{name}", str(getattr(self, name))]
        return shlex.join(words)


@dataclass(frozen=True)
class Model:
    section: dict  # the run config's model section
    shape: ModelShape
    seq_len: int
    name: str


@dataclass(frozen=True)
class Choice:
    """How the run is spread: the backend, its file, the batch split and why."""

    backend: str
    micro_batch: int
    accumulation: int
    activation_checkpointing: bool = False
    files: dict[str, dict] = field(default_factory=dict)  # {"ds_config.json": {...}}
    why: str = ""
    memory: str | None = None  # per GPU, as the planner counts it


@dataclass(frozen=True)
class Setup:
    files: dict[str, tuple[str, bool]]  # path -> (text, executable)
    summary: list[str]
    remarks: list[str]  # "Warning: ..." lines from the script builders
    next_command: str


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # what save_pretrained writes


def model_of(answers: Answers) -> Model:
    """The run config's model section and the shape the planner counts, for a built-in size or an HF folder."""
    if answers.model in BUILTIN_SIZES:
        size = BUILTIN_SIZES[answers.model]
        if answers.seq_len:
            size = replace(size, block_size=answers.seq_len)
        section = {"type": "gpt", "vocab_size": 256, "block_size": size.block_size}
        section.update(n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd)
        return Model(section, size.shape(), size.block_size, answers.model)
    config = hf_config_path(answers.model)
    context = hf_context_length(config)
    if answers.seq_len and context and answers.seq_len > context:
        raise DistsetupError(
            f"--seq_len {answers.seq_len} is longer than the {context} positions {answers.model}'s config.json allows.",
            f"give at most {context}.",
        )
    seq_len = answers.seq_len or min(context or LONGEST_DEFAULT_SEQUENCE, LONGEST_DEFAULT_SEQUENCE)
    section = {"type": "hf", "hf_path": answers.model, "block_size": seq_len}
    if any((Path(answers.model) / name).is_file() for name in TOKENIZER_FILES):  # the model's own tokenizer
        section["tokenizer"] = answers.model
    return Model(section, hf_shape_from_json(config, None), seq_len, Path(answers.model).name)


def hf_config_path(model: str) -> Path:
    """The config.json of a model folder, or the one-line error for a model that is neither size nor folder."""
    folder = Path(model)
    if not folder.is_dir():
        raise DistsetupError(
            f"--model {model} is neither a built-in size nor a folder.",
            f"give one of {', '.join(BUILTIN_SIZES)} or a local Hugging Face model folder"
            + (
                f"; for your own model ({model}), init a built-in size, then set model.type: python and model.builder "
                "in the run config (docs/own-code.md)."
                if ":" in model
                else "."
            ),
        )
    if not (folder / "config.json").is_file():
        raise DistsetupError(
            f"--model {model} has no config.json.",
            "give a folder that save_pretrained() wrote (config.json, weights optional).",
        )
    return folder / "config.json"


def cpu_choice(answers: Answers) -> Choice:
    per_rank = per_rank_batch(answers.global_batch_size, answers.num_nodes, answers.num_gpus_per_node)
    micro = max(m for m in range(1, min(per_rank, CPU_MICRO_BATCH) + 1) if per_rank % m == 0)
    backend = "ddp" if answers.world_size > 1 else "single"
    why = (
        "no GPU memory to plan for: every CPU process (gloo) holds the whole model, the simplest way to train on CPUs."
    )
    return Choice(backend, micro, per_rank // micro, why=why)


def gpu_choice(answers: Answers, model: Model) -> Choice:
    hardware = Hardware(
        num_nodes=answers.num_nodes,
        gpus_per_node=answers.num_gpus_per_node,
        gpu_memory=parse_memory(answers.gpu_memory or "", "--gpu_memory"),
    )
    per_rank_batch(answers.global_batch_size, answers.num_nodes, answers.num_gpus_per_node)
    work = Workload(precision=answers.precision, seq_len=model.seq_len, global_batch_size=answers.global_batch_size)
    # distsetup's trainer runs FSDP at fp32 and bf16 only
    allowed = tuple(s.key for s in STRATEGIES if s.framework != "fsdp" or answers.precision in TRAINER_PRECISIONS)
    result = plan(model.shape, hardware, work, allowed)
    chosen, micro, accumulation = result.choice, result.micro_batch, result.accumulation
    if chosen is None or micro is None or accumulation is None:
        raise DistsetupError(
            f"nothing fits: {model.name} ({in_words(model.shape.params)} parameters, {answers.precision}, "
            f"sequence {model.seq_len}) on {answers.num_nodes} node(s) x {answers.num_gpus_per_node} GPU(s) of "
            f"{hardware.gpu_memory / 1e9:g} GB.",
            "what would: " + " ".join(result.advice),
        )
    strategy = BY_KEY[chosen.strategy]
    backend = {"ddp": "ddp" if answers.world_size > 1 else "single"}.get(strategy.framework, strategy.framework)
    _, files, _ = recommended_files(result, run_config_optimizer(TrainingConfig()))  # the run config's: it sets none
    memory = f"{gb(chosen.total)} of {gb(chosen.usable)} GB usable per GPU" + (
        f", {gb(chosen.cpu_per_node)} GB of CPU memory per node" if chosen.cpu_per_node else ""
    )
    return Choice(
        backend,
        micro,
        accumulation,
        chosen.activation_checkpointing,
        files,
        why=why_chosen(result, allowed),
        memory=memory,
    )


def why_chosen(result: Plan, allowed: tuple[str, ...]) -> str:
    """The planner takes the fastest strategy that fits, first without recomputation, then with it, then with
    offload: name the faster ones and what they need per GPU at micro-batch 1 (so they do not fit at all)."""
    assert result.choice is not None
    chosen = BY_KEY[result.choice.strategy]
    order = candidates(result.hardware, allowed)
    faster = order[: order.index(chosen)]
    recompute = result.choice.activation_checkpointing or bool(chosen.offload)
    ckpt = " with activation checkpointing" if result.choice.activation_checkpointing else ""
    if not faster and not result.choice.activation_checkpointing:
        return f"{chosen.label}: the fastest strategy, and it fits."
    needs = [
        f"{s.label} {gb(estimate(s, result.model, result.hardware, result.workload, 1, recompute).total)} GB"
        for s in faster
    ]
    without = (
        f"; without recomputation not even micro-batch 1 fits ({chosen.label} "
        f"{gb(estimate(chosen, result.model, result.hardware, result.workload, 1, False).total)} GB)"
        if result.choice.activation_checkpointing
        else ""
    )
    return (
        f"{chosen.label}{ckpt}: the fastest strategy that fits {gb(result.choice.usable)} GB usable per GPU"
        + (
            f"; faster ones need more even at micro-batch 1"
            f"{' with activation checkpointing' if recompute else ' without recomputation'} ({', '.join(needs)})"
            if needs
            else ""
        )
        + without
        + "."
    )


def run_config(answers: Answers, model: Model, choice: Choice) -> dict:
    distributed: dict = {"backend": choice.backend}
    for name in choice.files:
        key = "deepspeed_config" if choice.backend == "deepspeed" else "fsdp_config"
        distributed[key] = f"{CONFIG_FOLDER}/{name}"
    return {
        "model": model.section,
        "data": {"type": "files", "paths": list(answers.data)} if answers.data else {"type": "synthetic"},
        "training": {
            "micro_batch_size": choice.micro_batch,
            "gradient_accumulation_steps": choice.accumulation,
            "max_steps": answers.max_steps,
            # the default's 20 steps, or a tenth of a shorter run's: the peak lr is reached well before its end
            "warmup_steps": min(TrainingConfig.warmup_steps, answers.max_steps // 10),
            "precision": answers.precision,
            "activation_checkpointing": "full" if choice.activation_checkpointing else "none",
            "checkpoint_interval": min(answers.max_steps, 200),
            "output_dir": f"runs/{model.name}",
        },
        "distributed": distributed,
    }


def build_setup(answers: Answers, workdir: str) -> Setup:
    """Every file init writes, checked, and what to tell the user."""
    check_world_counts(answers.num_nodes, answers.num_gpus_per_node)
    model = model_of(answers)
    choice = gpu_choice(answers, model) if answers.gpu_memory else cpu_choice(answers)
    config = run_config(answers, model, choice)
    refuse_generated_problems(config_problems(config, None))
    script = SCRIPTS[answers.scheduler]
    runner = "sbatch" if answers.scheduler == "slurm" else "bash"
    header = HEADER.format(command=answers.command_line(), run=f"{runner} {script}")
    files = {RUN_CONFIG: (header + yaml.safe_dump(config, sort_keys=False), False)}
    for name, data in choice.files.items():
        refuse_generated_problems(
            deepspeed_problems(data, answers.world_size) if choice.backend == "deepspeed" else fsdp_problems(data)
        )
        files[f"{CONFIG_FOLDER}/{name}"] = (json_text(data), False)
    launch = LaunchSpec(
        backend=choice.backend,
        workdir=workdir,
        config=RUN_CONFIG,
        deepspeed_config=config["distributed"].get("deepspeed_config"),
        fsdp_config=config["distributed"].get("fsdp_config"),
        num_nodes=answers.num_nodes,
        nproc_per_node=answers.num_gpus_per_node,
        rdzv_backend="c10d" if answers.scheduler == "slurm" else "static",
        backend_from_run_config=config["distributed"]["backend"] == choice.backend,  # read when the run starts
    )
    if answers.scheduler == "slurm":
        slurm = SlurmSpec(
            launch=launch,
            gpu_request="gres" if answers.gpu_memory else "none",
            time_limit=answers.time_limit,
            partition=answers.partition,
            account=answers.account,
            venv=answers.venv,
            cpus_per_task=answers.cpus_per_task,
            requeue=True,
        )
        text, run_command = build_slurm_script(slurm, answers.command_line(), script), f"sbatch {script}"
        # SLURM names the nodes: no launch_warnings
        warnings = slurm_warnings(slurm) + venv_warnings(slurm.venv, slurm.launch.workdir)
    else:
        text, run_command = build_launcher_script(launch, answers.command_line(), script), f"bash {script}"
        warnings = launch_warnings(launch, run_command)
        if answers.num_nodes > 1:
            run_command = f"NODE_RANK=<0..{answers.num_nodes - 1}> MASTER_ADDR=<node 0> {run_command}  # on each node"
    files[script] = (text, True)
    return Setup(files, summary(answers, model, choice), [f"Warning: {w}" for w in warnings], run_command)


HEADER = """\
# distsetup run config, written by:
#   {command}
# Check it with `distsetup validate config/config.yaml`; any key can be overridden at launch,
# e.g. `{run} training.max_steps=50`.
"""


def summary(answers: Answers, model: Model, choice: Choice) -> list[str]:
    processes = "GPU(s)" if answers.gpu_memory else "CPU process(es) (no GPU memory given: a CPU setup, gloo)"
    where = (
        f"SLURM ({answers.num_nodes} node(s)"
        + (f", partition {answers.partition}" if answers.partition else "")
        + (f", time {answers.time_limit}" if answers.time_limit else "")
        + "; checkpointed and requeued when preempted or near the time limit)"
        if answers.scheduler == "slurm"
        else "this machine"
        if answers.num_nodes == 1
        else f"{answers.num_nodes} machines, one script each"
    )
    lines = [
        f"Model: {model.name}, {in_words(model.shape.params)} parameters, sequence {model.seq_len}; "
        f"data: {', '.join(answers.data) or 'synthetic'}; {answers.precision}.",
        f"World: {answers.num_nodes} node(s) x {answers.num_gpus_per_node} {processes} = {answers.world_size}, "
        f"on {where}.",
        f"Strategy: {choice.why}" if answers.gpu_memory else f"Strategy: {choice.backend.upper()}, {choice.why}",
        f"Batch: micro-batch {choice.micro_batch} x accumulation {choice.accumulation} x {answers.world_size} = "
        f"global batch {answers.global_batch_size}.",
    ]
    if choice.memory:
        lines.append(f"Memory: {choice.memory}.")
    return lines


def refuse_existing(paths, force: bool) -> list[str]:
    """The paths that exist; without `force` the first of them is an error."""
    existing = [path for path in paths if Path(path).exists() or Path(path).is_symlink()]
    if existing and not force:
        raise DistsetupError(
            f"{existing[0]} exists: distsetup init writes over no file unless told to.",
            "add --force to replace what init writes, or run it in another folder.",
        )
    return existing


def write_setup(files: dict[str, tuple[str, bool]], force: bool) -> None:
    """Write every file, or none: a file that exists is replaced only with `force`, and a failure (or Ctrl-C)
    part-way puts back what was there."""
    existing = refuse_existing(files, force)
    before = {path: Path(path).read_bytes() for path in existing if Path(path).is_file()}
    new_folders = [folder for folder in {str(Path(p).parent) for p in files} if not Path(folder).exists()]
    written: list[str] = []
    try:
        for path, (text, executable) in files.items():
            try:
                write_atomic(Path(path), text, executable=executable, option="init:")
            except DistsetupError as e:
                raise DistsetupError(e.problem, "run distsetup init in a folder you can write to.") from None
            written.append(path)
    except BaseException:
        for path in written:
            if path in before:
                Path(path).write_bytes(before[path])
            else:
                Path(path).unlink(missing_ok=True)
        for folder in new_folders:
            if Path(folder).is_dir() and not any(Path(folder).iterdir()):
                Path(folder).rmdir()
        raise

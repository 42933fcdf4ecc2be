"""Which of a run config and its backend file decides each setting both can hold: the batch, the precision, the
gradient clipping, the optimizer's lr (and whether training.scale_lr scales it) and the scheduler. One function,
`settle`, asked by the trainer's backends, `doctor`, `validate` of a run config and `launcher`/`slurm`, so that all of
them say the same.

The rules: a value the backend file holds decides, and a note says so where the run config's differs; a value the
file leaves out comes from the run config (the trainer writes it into the DeepSpeed config it hands DeepSpeed). The
batch is stricter: where the run config writes a batch value (or an override sets it) and the DeepSpeed file holds
another, the run stops before it starts, naming both -- a global batch 16 times smaller is never trained silently.
Given the world size, it also holds the run config to it: backend single trains one process.
"""

from dataclasses import dataclass, field

from distsetup.formats.batch import FILE_KEYS, BatchMismatch, complete_batch, global_batch_of
from distsetup.formats.deepspeed import AUTO, PRECISION_SECTIONS, enabled_precisions, precision_of
from distsetup.formats.fsdp import TRAINER_FP16_PROBLEM, TRAINER_PRECISIONS, FsdpSpec
from distsetup.formats.lr_scaling import scaled_lr
from distsetup.formats.problems import Problem
from distsetup.formats.runconfig import RunConfig

DEEPSPEED_FILE = "the DeepSpeed file"
FSDP_FILE = "the FSDP settings"


@dataclass
class Settled:
    """The values a run trains with, where each came from ("training.lr", "the DeepSpeed file's optimizer"), the
    notes to print and the problems that stop the run."""

    micro_batch: int
    accumulation: int
    train_batch: int | None  # None: the world size is not known yet
    precision: str
    grad_clip: float
    lr: float
    scheduler: str  # "warmup-cosine" (distsetup's) or the DeepSpeed file's scheduler type
    activation_checkpointing: str  # none, full or selective
    lr_scaled: bool = False  # training.scale_lr scaled the run config's lr to the global batch
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def settle(
    cfg: RunConfig, deepspeed: dict | None, fsdp: FsdpSpec | None, world_size: int | None, file_name: str = ""
) -> Settled:
    """The settled values for a run config and its backend file (the DeepSpeed file's dict, or the FSDP spec of its
    file or inline settings). `world_size` None: what needs it (the train batch) stays open."""
    t = cfg.training
    settled = Settled(
        t.micro_batch_size,
        t.gradient_accumulation_steps,
        None if world_size is None else global_batch_of(t.micro_batch_size, t.gradient_accumulation_steps, world_size),
        t.precision,
        t.grad_clip,
        t.lr,
        "warmup-cosine",
        t.activation_checkpointing,
    )
    for name, key in (
        ("micro_batch", "micro_batch_size"),
        ("accumulation", "gradient_accumulation_steps"),
        ("precision", "precision"),
        ("grad_clip", "grad_clip"),
        ("lr", "lr"),
        ("activation_checkpointing", "activation_checkpointing"),
    ):
        settled.sources[name] = _run_config_source(cfg, key)
    settled.sources["train_batch"] = "micro x accumulation x world size"
    if cfg.distributed.find_unused_parameters is not None and cfg.distributed.backend != "ddp":
        settled.notes.append(
            f"distributed.find_unused_parameters is DDP's: {cfg.distributed.backend} takes a parameter without a "
            "gradient as it is"
        )
    if cfg.distributed.backend == "single" and world_size is not None and world_size > 1:
        settled.problems.append(
            Problem(
                "distributed.backend",
                f"single trains one process, without a process group, and the world has {world_size} processes.",
                "set distributed.backend to ddp (or fsdp, deepspeed; the scripts of `distsetup launcher` and `slurm` "
                "train several processes with ddp), or launch one process.",
            )
        )
    settled.sources["scheduler"] = "training.warmup_steps and training.min_lr_ratio"
    if deepspeed is not None:
        _settle_deepspeed(settled, cfg, deepspeed, world_size, file_name or DEEPSPEED_FILE)
    if fsdp is not None and fsdp.precision != "fp32":  # an fp32 FSDP file says nothing about the precision
        _decide(settled, cfg, "precision", fsdp.precision, f"{FSDP_FILE}' mixed_precision")
    # the FSDP settings' precision (a run config's own fp16 beside FSDP is refused by its rules, before)
    from_the_file = settled.sources["precision"] == f"{FSDP_FILE}' mixed_precision"
    if cfg.distributed.backend == "fsdp" and from_the_file and settled.precision not in TRAINER_PRECISIONS:
        file = cfg.distributed.fsdp_config
        where = f"FSDP file {file}" if file else "distributed.fsdp"
        problem, fix = TRAINER_FP16_PROBLEM
        how = "`distsetup fsdp --mixed_precision BFLOAT16` writes a bf16 file" if file else "mixed_precision: BFLOAT16"
        fix = f"{fix.removesuffix('.')} ({how})."
        settled.problems.append(Problem(f"{where}: mixed_precision", problem, fix))
    if fsdp is not None and fsdp.activation_checkpointing and settled.activation_checkpointing == "none":
        # the file's flag turns it on (full) where the run config leaves it off; the file's False says nothing
        _decide(settled, cfg, "activation_checkpointing", "full", f"{FSDP_FILE}' fsdp_activation_checkpointing")
    _scale_lr(settled, cfg)
    _warmup_note(settled, cfg)
    return settled


def _warmup_note(settled: Settled, cfg: RunConfig) -> None:
    """A warmup as long as the run (training.max_steps; the default warmup of 20 steps in a short run): the learning
    rate never reaches its peak."""
    t = cfg.training
    if t.epochs is None and settled.sources["scheduler"].startswith("training.") and t.warmup_steps >= t.max_steps:
        settled.notes.append(
            f"training.warmup_steps {t.warmup_steps} is not shorter than training.max_steps {t.max_steps}: the "
            "learning rate rises the whole run and never reaches its peak (set warmup_steps lower)"
        )


def _scale_lr(settled: Settled, cfg: RunConfig) -> None:
    """training.scale_lr: the run config's lr, tuned at training.base_batch_size, scaled to the global batch once the
    world size is known. A backend file's lr is used as written: `distsetup deepspeed --scale_lr` may have scaled it
    already."""
    t = cfg.training
    if t.scale_lr == "none":
        if t.base_batch_size is not None:  # set for scaling, which is off: the lr would silently stay as written
            settled.notes.append(
                f"training.base_batch_size {t.base_batch_size} is unused: the lr is scaled to the global batch only "
                "with training.scale_lr linear or sqrt"
            )
        return
    if not settled.sources["lr"].startswith("training."):
        settled.notes.append(
            f"training.scale_lr {t.scale_lr} not applied: the lr of {settled.sources['lr']} is used as written "
            "(scale it there with `distsetup deepspeed --scale_lr`)"
        )
    elif settled.train_batch is not None:
        settled.lr, settled.lr_scaled = scaled_lr(t.lr, settled.train_batch, t.base_batch_size, t.scale_lr), True
        settled.sources["lr"] = f"training.lr scaled ({t.scale_lr}) from batch {t.base_batch_size}"


def _run_config_source(cfg: RunConfig, key: str) -> str:
    name = f"training.{key}"
    return cfg.written.get(name) or f"{name} (default)"


def _written(cfg: RunConfig, key: str) -> str | None:
    """How the run config wrote training.`key` ("distributed.gradient_accumulation_steps"), or None: a default."""
    source = _run_config_source(cfg, key)
    return None if source.endswith("(default)") else source


def _decide(settled: Settled, cfg: RunConfig, name: str, value, source: str, key: str | None = None) -> None:
    """The file's value decides; a note where the run config wrote another."""
    mine = getattr(settled, name)
    if value != mine:
        written = _written(cfg, key or name)
        settled.notes.append(
            f"{name.replace('_', ' ')} {value} from {source}"
            + (f" (the run config's {written} says {mine})" if written else "")
            + "."
        )
    setattr(settled, name, value)
    settled.sources[name] = source


def _settle_deepspeed(settled: Settled, cfg: RunConfig, config: dict, world_size: int | None, file: str) -> None:
    _settle_batch(settled, cfg, config, world_size, file)
    if enabled_precisions(config) or any(key in config for key in PRECISION_SECTIONS):
        _decide(settled, cfg, "precision", precision_of(config), f"{file}'s fp16/bf16 sections")
    if isinstance(config.get("gradient_clipping"), (int, float)) and not isinstance(config["gradient_clipping"], bool):
        _decide(settled, cfg, "grad_clip", config["gradient_clipping"], f"{file}'s gradient_clipping")
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.get("params") or {}
        lr = params.get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            _decide(settled, cfg, "lr", lr, f"{file}'s optimizer {optimizer.get('type')}")
        # DeepSpeed builds the optimizer from the block: its other settings decide too, said where they differ
        t = cfg.training
        for key, mine in (("betas", list(t.betas)), ("weight_decay", t.weight_decay)):
            theirs = params.get(key)
            if theirs is not None and theirs != AUTO and theirs != mine:
                settled.notes.append(
                    f"{key} {theirs} from {file}'s optimizer {optimizer.get('type')} (the run config's "
                    f"{_run_config_source(cfg, key)} says {mine})."
                )
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        settled.scheduler, settled.sources["scheduler"] = str(scheduler.get("type")), f"{file}'s scheduler"
        settled.notes.append(f"LR scheduler {scheduler.get('type')} from {file}.")


def _settle_batch(settled: Settled, cfg: RunConfig, config: dict, world_size: int | None, file: str) -> None:
    """The file's batch values decide where it has them, but never over a value the run config writes: a
    contradiction is a problem naming both. Values the file leaves out come from the run config."""
    held: dict[str, int] = {
        key: value
        for key in (FILE_KEYS.micro, FILE_KEYS.accumulation, FILE_KEYS.train)
        if isinstance(value := config.get(key), int) and not isinstance(value, bool) and value > 0
    }
    if not held:
        return
    pairs = (
        ("micro_batch", "micro_batch_size", FILE_KEYS.micro),
        ("accumulation", "gradient_accumulation_steps", FILE_KEYS.accumulation),
    )
    values = {}
    for name, key, file_key in pairs:
        written = _written(cfg, key)
        if file_key in held and written and held[file_key] != getattr(settled, name):
            settled.problems.append(_contradiction(written, getattr(settled, name), file, file_key, held[file_key]))
        values[name] = held.get(file_key, getattr(settled, name) if written else None)
    if settled.problems or world_size is None:
        for name, _, file_key in pairs:
            if file_key in held:
                _decide(settled, cfg, name, held[file_key], f"{file}'s {file_key}")
        return
    micro, accumulation = values["micro_batch"], values["accumulation"]
    if micro is None and FILE_KEYS.train not in held:
        micro = settled.micro_batch
    try:
        sizes = complete_batch(micro, accumulation, held.get(FILE_KEYS.train), world_size, FILE_KEYS)
    except BatchMismatch as e:
        settled.problems.append(
            Problem(
                "training.micro_batch_size",
                f"{file}'s {FILE_KEYS.train} {e.message} (with the run config's batch values).",
                f"make them agree: remove {FILE_KEYS.train} from {file}, or the run config's batch values.",
            )
        )
        return
    for name, _, file_key in pairs:
        value = sizes.micro if name == "micro_batch" else sizes.accumulation
        if value != getattr(settled, name) or file_key in held:
            source = f"{file}'s {file_key}" if file_key in held else f"{file}'s {FILE_KEYS.train}"
            _decide(settled, cfg, name, value, source)
    settled.train_batch = sizes.train_batch


def _contradiction(written: str, mine: int, file: str, file_key: str, theirs: int) -> Problem:
    return Problem(
        written,
        f"the run config's {written} is {mine}, {file}'s {file_key} is {theirs}.",
        f"remove one of the two: {written} (then {file} decides), or {file_key} from {file} (then the run config "
        "decides; `distsetup deepspeed` writes no batch keys without batch flags).",
    )

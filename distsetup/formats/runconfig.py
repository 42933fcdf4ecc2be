"""The run config (config.yaml): one dataclass per section, loaded strictly, checked across fields once.

Each field's metadata also yields the JSON Schema shipped as distsetup/formats/schemas/run_config.schema.json
(`python -m distsetup.formats.runconfig > distsetup/formats/schemas/run_config.schema.json` regenerates it).
"""

import dataclasses
import json
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from distsetup.errors import DistsetupError
from distsetup.formats import python_refs
from distsetup.formats.fsdp import TRAINER_FP16_PROBLEM, TRAINER_PRECISIONS, inline_findings, read_inline
from distsetup.formats.lr_scaling import RULES
from distsetup.formats.other_names import hint, read_other_names
from distsetup.formats.problems import Problem, join_path, schema_problems
from distsetup.formats.reading import parse_yaml, read_yaml

BACKENDS = ("single", "ddp", "fsdp", "deepspeed")
MODEL_TYPES = ("gpt", "hf", "python")
DATA_TYPES = ("synthetic", "files", "python")
FORMATS = ("text", "prompt_completion", "chat")
REPORTERS = ("tensorboard", "wandb")
CHECKPOINTING = ("none", "full", "selective")  # besides metrics.jsonl, which is always written
TEXT_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets' builders
TEXT_SUFFIXES = tuple(TEXT_LOADERS)
TOKEN_SUFFIX = ".bin"  # a pre-tokenized token file
PRECISIONS = ("fp32", "bf16", "fp16")
# Upper bounds on the model's shape that no real model reaches (the largest published: about 128 layers of
# hidden size 16-25k with 128 heads, vocabularies of 256k tokens, contexts of 10M tokens); a larger value is
# a typo, and would make `distsetup plan` compute with absurd numbers or the trainer allocate without end.
MODEL_MAXIMA = {"vocab_size": 2**20, "block_size": 2**24, "n_layer": 4096, "n_head": 1024, "n_embd": 2**17}


def setting(default, doc: str, **schema):
    """A config field with its documentation and extra JSON Schema constraints (enum, minimum, ...)."""
    mutable = isinstance(default, (list, dict))
    kwargs = {"default_factory": lambda: type(default)(default)} if mutable else {"default": default}
    return field(metadata={"doc": doc, **schema}, **kwargs)


@dataclass
class ModelConfig:
    """The model: the built-in GPT, a Hugging Face causal LM from a local folder, or the user's own module."""

    type: str = setting(
        "gpt",
        "gpt (built in), hf (a transformers causal LM from hf_path) or python (model.builder builds it)",
        enum=list(MODEL_TYPES),
    )
    builder: str | None = setting(
        None,
        "module:function returning the nn.Module (type python), imported from the run config's folder or PYTHONPATH",
    )
    args: dict = setting({}, "keyword arguments for model.builder")
    vocab_size: int = setting(
        256, "vocabulary size; 256 = bytes; at most 2^20", minimum=1, maximum=MODEL_MAXIMA["vocab_size"]
    )
    block_size: int = setting(
        64, "sequence length in tokens; at most 2^24", minimum=2, maximum=MODEL_MAXIMA["block_size"]
    )
    n_layer: int = setting(2, "transformer blocks; at most 4096", minimum=1, maximum=MODEL_MAXIMA["n_layer"])
    n_head: int = setting(4, "attention heads per block; at most 1024", minimum=1, maximum=MODEL_MAXIMA["n_head"])
    n_embd: int = setting(
        64, "hidden size; a multiple of n_head; at most 2^17", minimum=1, maximum=MODEL_MAXIMA["n_embd"]
    )
    dropout: float = setting(0.0, "dropout probability", minimum=0, maximum=1)
    hf_path: str | None = setting(None, "local folder with a config.json (and weights, if a checkpoint)")
    layer_classes: list[str] = setting(
        [],
        "the repeated blocks' classes: what FSDP2 shards, activation checkpointing recomputes and compile compiles; "
        "default: the model's own (gpt: Block; hf: its _no_split_modules; python: the class of the children of its "
        "largest nn.ModuleList or nn.Sequential of one class of its own); layer_cls: X is read as [X]",
    )
    zero3_leaf_classes: list[str] = setting(
        [],
        "classes ZeRO-3 gathers whole and every backend treats as run conditionally (an MoE layer whose experts "
        "differ between ranks); those holding an nn.ModuleList/ModuleDict of like experts are found by themselves",
    )
    tokenizer: str | None = setting(
        None, "local Hugging Face tokenizer folder (AutoTokenizer; nothing is downloaded); default: bytes (UTF-8)"
    )


@dataclass
class DataConfig:
    """Training data: a synthetic task, or the user's files, tokenized once into a cache that every rank maps."""

    type: str = setting(
        "synthetic", "synthetic, files, or python (data.builder returns a map-style dataset)", enum=list(DATA_TYPES)
    )
    builder: str | None = setting(
        None, 'module:function(split, **args) returning a map-style Dataset for "train" and "val" (None: no validation)'
    )
    args: dict = setting({}, "keyword arguments for data.builder")
    collate: str | None = setting(
        None, "module:function that makes a batch of samples; default: torch's default_collate"
    )
    num_workers: int = setting(
        0, "DataLoader worker processes that load samples ahead of the step (per rank; 0: in the trainer)", minimum=0
    )
    paths: list[str] = setting(
        [], ".txt, .jsonl, .json or .parquet files, or one pre-tokenized .bin (with its .bin.json sidecar)"
    )
    val_paths: list[str] = setting([], "validation files, of the kind paths holds")
    val_fraction: float = setting(
        0.0, "hold out this fraction of the records (drawn with training.seed) for validation", minimum=0, maximum=0.5
    )
    format: str = setting(
        "text", "text, prompt_completion or chat: what the records hold and which tokens carry loss", enum=list(FORMATS)
    )
    text_field: str = setting("text", "the field holding the text (format text)")
    prompt_field: str = setting("prompt", "the field holding the prompt (format prompt_completion)")
    completion_field: str = setting("completion", "the field holding the completion (format prompt_completion)")
    messages_field: str = setting("messages", "the field holding the list of {role, content} messages (format chat)")
    cache_dir: str | None = setting(None, "where tokenized text is kept; default: training.output_dir/token_cache")
    num_samples: int = setting(4096, "samples in the synthetic task", minimum=1)


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    seed: int = setting(1234, "seed for weights, data order and dropout")
    loss: str | None = setting(
        None,
        "module:function(model, batch) returning the micro-batch's mean loss; default: token cross-entropy (token "
        "data), else model(**batch) or model(*batch), its .loss where it has one",
    )
    micro_batch_size: int = setting(8, "samples per process per forward pass", minimum=1)
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", minimum=1)
    max_steps: int = setting(200, "optimizer steps in the whole run", minimum=1)
    epochs: int | None = setting(None, "passes over the training data, instead of max_steps", minimum=1)
    eval_interval: int | None = setting(
        None, "evaluate on the validation set every N steps (and at the end, always, when there is one)", minimum=1
    )
    lr: float = setting(1e-3, "peak learning rate (before scaling)", exclusiveMinimum=0)
    min_lr_ratio: float = setting(0.1, "cosine decay ends at lr x this", minimum=0, maximum=1)
    warmup_steps: int = setting(20, "linear warmup steps", minimum=0)
    weight_decay: float = setting(0.01, "AdamW weight decay", minimum=0)
    betas: list[float] = setting([0.9, 0.95], "AdamW betas", minItems=2, maxItems=2)
    grad_clip: float = setting(1.0, "clip the gradient norm to this; 0 disables", minimum=0)
    precision: str = setting("fp32", "fp32, bf16 or fp16", enum=list(PRECISIONS))
    scale_lr: str = setting("none", "scale lr with the global batch: none, linear or sqrt", enum=list(RULES))
    base_batch_size: int | None = setting(None, "global batch size that lr was tuned for", minimum=1)
    activation_checkpointing: str = setting(
        "none",
        "recompute each block's activations in backward: none, full, or selective (all but its matmul and "
        "attention outputs); true and false read as full and none",
        enum=list(CHECKPOINTING),
    )
    compile: bool = setting(False, "torch.compile each block (with its activation checkpointing)")
    chunked_loss: str = setting(
        "auto",
        "the token cross-entropy a slice of the vocabulary at a time, so the logits never exist whole (the built-in "
        "GPT and Hugging Face models): auto (from a vocabulary of 32000 ids), always or never",
        enum=["auto", "always", "never"],
    )
    checkpoint_interval: int = setting(50, "save every N steps (and at the end)", minimum=1)
    keep_checkpoints: int | None = setting(
        None,
        "keep the N newest complete checkpoints (older ones go once a newer one is complete); default all",
        minimum=1,
    )
    async_checkpoint: bool = setting(
        False, "write checkpoints in the background: the loop waits only for a copy in memory (not DeepSpeed)"
    )
    output_dir: str = setting("runs/demo", "checkpoints, metrics and the run summary")
    log_interval: int = setting(10, "print and log metrics every N steps", minimum=1)
    report_to: list[str] | None = setting(
        None,
        "where metrics go besides metrics.jsonl: tensorboard, wandb; default: tensorboard where it is installed",
        items={"type": "string", "enum": list(REPORTERS)},
    )
    run_name: str | None = setting(None, "the run's name in W&B; default: W&B's own")
    wandb_project: str | None = setting(None, "the W&B project; default: WANDB_PROJECT, else W&B's own")
    wandb_tags: list[str] = setting([], "the W&B run's tags")
    peak_tflops: float | None = setting(
        None,
        "one device's dense peak TFLOP/s in the training precision, for MFU; default: the GPU's bf16/fp16 figure",
        exclusiveMinimum=0,
    )


@dataclass
class DistributedConfig:
    """How the run is spread over processes."""

    backend: str = setting("ddp", "single, ddp, fsdp or deepspeed", enum=list(BACKENDS))
    deepspeed_config: str | None = setting(None, "DeepSpeed JSON (backend: deepspeed)")
    fsdp_config: str | None = setting(None, "FSDP JSON (backend: fsdp); default: full shard of each block")
    fsdp: dict = setting(
        {},
        "the FSDP file's settings inline, instead of fsdp_config; the guides' fsdp_* keys written under distributed "
        "(fsdp_sharding_strategy: full_shard, fsdp_mixed_precision: true with fsdp_param_dtype: bfloat16, ...) are "
        "read into it",
    )
    use_deepspeed: bool = setting(False, "same as backend: deepspeed (the guides' spelling)")
    use_fsdp: bool = setting(False, "same as backend: fsdp (the guides' spelling)")
    timeout_minutes: float = setting(
        30, "collective timeout in minutes (fractions allowed); a dead rank ends the job after this", exclusiveMinimum=0
    )


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # not sections: how the file was read
    notes: list[str] = field(default_factory=list)  # other tools' names read as distsetup's keys, ...
    # the keys the file (or an override) sets, each as written: {"training.lr": "training.learning_rate"}
    written: dict[str, str] = field(default_factory=dict)


SECTIONS = {  # section name -> its dataclass, in field order
    name: cls for name, cls in typing.get_type_hints(RunConfig).items() if dataclasses.is_dataclass(cls)
}


@dataclass
class Checked:
    """What checking a raw run config found: its problems, the notes on how it was read, the keys it sets."""

    problems: list[Problem]
    notes: list[str]
    written: dict[str, str]  # as RunConfig.written


def run_config_schema() -> dict:
    """The JSON Schema of config.yaml, derived from the dataclasses above."""
    sections = {name: _section_schema(cls) for name, cls in SECTIONS.items()}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "distsetup run config",
        "type": "object",
        "additionalProperties": False,
        "properties": sections,
    }


def _section_schema(cls) -> dict:
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        extra = {k: v for k, v in f.metadata.items() if k != "doc"}
        props[f.name] = {"description": f.metadata["doc"], **_json_type(hints[f.name]), **extra}
    return {"type": "object", "description": cls.__doc__, "additionalProperties": False, "properties": props}


def _json_type(hint) -> dict:
    names = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object"}
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return {"type": "array", "items": {"type": names[args[0]]}}
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        if typing.get_origin(inner) is list:
            return {"type": ["array", "null"], "items": {"type": names[typing.get_args(inner)[0]]}}
        return {"type": [names[inner], "null"]}
    return {"type": names[hint]}


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` overrides (values parsed as YAML) to a raw config dict."""
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.partition(".")
        if not (sep and dot and key):
            raise DistsetupError(
                f"override '{item}' is not of the form section.key=value.", "write e.g. training.lr=3e-4"
            )
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise DistsetupError(
                f"override '{item}': '{section}' is not a section.", f"sections are {', '.join(SECTIONS)}."
            )
        try:
            raw[section][key] = parse_yaml(value)
        except (yaml.YAMLError, ValueError):  # ValueError: a bad date, a 5000-digit integer, a bomb
            raise DistsetupError(
                f"override '{item}': the value is not valid YAML.",
                f"quote it: {dotted}='\"...\"' (a path or a string).",
            )
    return raw


def config_problems(raw: dict, base_dir: Path | None = None) -> list[Problem]:
    return check_run_config(raw, base_dir).problems


def check_run_config(raw: dict, base_dir: Path | None = None) -> Checked:
    """Every problem in a raw run config: keys that are not names, other tools' names (read as distsetup's, in
    place), the schema (unknown keys, types, ranges, NaN and infinities), what the schema cannot say (whole numbers,
    blank names), then cross-field rules; with the notes on how it was read."""
    problems = _key_problems(raw)
    if problems:
        return Checked(problems, [], {})
    notes, problems, spelled = _read_other_spellings(raw)
    written = {
        f"{section}.{key}": f"{section}.{key}"
        for section, values in raw.items()
        if isinstance(values, dict)
        for key in values
    } | spelled
    if problems:
        return Checked(problems, notes, written)
    problems = schema_problems(raw, "run_config", hint)
    reported = {p.path for p in problems}
    problems += [p for p in _value_problems(raw) if p.path not in reported]
    if not problems:
        problems = _cross_field_problems(_build(raw), base_dir) + _step_count_problems(raw)
        inline = (raw.get("distributed") or {}).get("fsdp")
        if inline:
            found, said = inline_findings(inline)
            problems += found
            notes += said
    return Checked(problems, notes, written)


def _read_other_spellings(raw: dict) -> tuple[list[str], list[Problem], dict[str, str]]:
    """Older spellings of distsetup's keys, other tools' names, and FSDP settings written inline."""
    problems = _read_old_spellings(raw)
    notes, found, spelled = read_other_names(raw)
    problems += found
    distributed = raw.get("distributed")
    if isinstance(distributed, dict) and any(k.startswith("fsdp_") and k != "fsdp_config" for k in distributed):
        block, said, found = read_inline(distributed)
        notes += said
        problems += found
        if "fsdp" in distributed:
            problems.append(
                Problem(
                    "distributed.fsdp",
                    "FSDP settings are written both as distributed.fsdp and as fsdp_* keys beside it.",
                    "keep one of the two forms.",
                )
            )
        else:
            distributed["fsdp"] = block
    return notes, problems, spelled


def _step_count_problems(raw: dict) -> list[Problem]:
    training = raw.get("training") or {}
    if "epochs" in training and "max_steps" in training:
        return [Problem("training.epochs", "epochs and max_steps are both set.", "keep one of them.")]
    return []


def _read_old_spellings(raw: dict) -> list[Problem]:
    """training.activation_checkpointing was a boolean before it had modes: true is full, false none; model.layer_cls
    named one class before model.layer_classes named several."""
    training, model = raw.get("training"), raw.get("model")
    if isinstance(training, dict) and isinstance(training.get("activation_checkpointing"), bool):
        training["activation_checkpointing"] = "full" if training["activation_checkpointing"] else "none"
    if isinstance(model, dict) and "layer_cls" in model:
        single = model.pop("layer_cls")
        if "layer_classes" in model and model["layer_classes"] != [single]:
            return [
                Problem(
                    "model.layer_cls",
                    f"layer_cls {single!r} and layer_classes {model['layer_classes']!r} name different classes.",
                    "keep layer_classes alone.",
                )
            ]
        model["layer_classes"] = [single] if single is not None else []
    return []


def _key_problems(data, path=()) -> list[Problem]:
    """Keys that YAML read as something other than a name: `1:`, `yes:` (true), `null:`, a date."""
    if isinstance(data, list):
        return [p for i, item in enumerate(data) for p in _key_problems(item, path + (i,))]
    if not isinstance(data, dict):
        return []
    problems = []
    for key, value in data.items():
        if isinstance(key, str):
            problems += _key_problems(value, path + (key,))
        else:
            problems.append(
                Problem(
                    join_path(path + (repr(key),)),
                    f"key {key!r} ({type(key).__name__}) is not a name.",
                    "write the key's name, e.g. micro_batch_size; quote it if YAML reads it "
                    "as a number, a boolean or a date.",
                )
            )
    return problems


def _value_problems(raw: dict) -> list[Problem]:
    """What JSON Schema cannot say: an integer field holds a Python int (the schema's "integer" takes 8.0,
    which the trainer cannot use as a batch size), and a text field that names something is not blank."""
    problems = []
    for section, cls in SECTIONS.items():
        values = raw.get(section)
        if not isinstance(values, dict):
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            value, kinds, where = values[f.name], _scalar_types(hints[f.name]), f"{section}.{f.name}"
            if int in kinds and isinstance(value, float):
                example = int(value) if value.is_integer() and abs(value) <= 2**53 else f.default
                problems.append(Problem(where, f"{value!r} is not a whole number.", f"write e.g. {example}."))
            if (
                str in kinds
                and "enum" not in f.metadata
                and any(
                    isinstance(item, str) and not item.strip()
                    for item in (value if isinstance(value, list) else [value])
                )
            ):
                problems.append(Problem(where, "is empty.", f"write a value, or remove {f.name} for the default."))
    return problems


def _scalar_types(hint) -> set:
    """int | None -> {int, NoneType}; list[str] -> {str}; int -> {int}."""
    return set(typing.get_args(hint)) or {hint}


def load_run_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read config.yaml (or the defaults when path is None), apply overrides, and check it all."""
    raw = read_yaml(Path(path)) if path else {}
    raw = apply_overrides(raw, list(overrides))
    checked = check_run_config(raw, Path(path).parent if path else None)
    problems = checked.problems
    if problems:
        where = f" in {path}" if path else ""
        raise DistsetupError(
            f"run config problem{where}: {problems[0]}"
            + (f" (and {len(problems) - 1} more; run `distsetup validate`)" if len(problems) > 1 else "")
        )
    return run_config_from(raw, checked)


def run_config_from(raw: dict, checked: Checked) -> RunConfig:
    """The RunConfig of a raw config that check_run_config found no problem in (and read into distsetup's keys)."""
    config = _build(raw)
    config.notes, config.written = checked.notes, checked.written
    return config


def model_config(section: dict) -> ModelConfig:
    """A model section as stored in a checkpoint's marker (older ones spell layer_cls) as a ModelConfig."""
    raw = {"model": dict(section)}
    _read_old_spellings(raw)
    return ModelConfig(**raw["model"])


def backend_of(distributed: dict) -> str:
    """The backend a raw `distributed` section selects: an explicit backend, else the guides' keys."""
    if "backend" in distributed:
        return distributed["backend"]
    if distributed.get("use_deepspeed") is True:
        return "deepspeed"
    return "fsdp" if distributed.get("use_fsdp") is True else DistributedConfig.backend


def _build(raw: dict) -> RunConfig:
    sections: dict = {name: cls(**raw.get(name, {})) for name, cls in SECTIONS.items()}  # type: ignore[operator]
    config = RunConfig(**sections)
    config.distributed.backend = backend_of(raw.get("distributed", {}))
    return config


def _cross_field_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    problems = []
    dist, model, training = config.distributed, config.model, config.training
    if dist.use_deepspeed and dist.use_fsdp:
        problems.append(
            Problem(
                "distributed",
                "use_deepspeed and use_fsdp are both true.",
                "choose one: backend: deepspeed or backend: fsdp.",
            )
        )
    for flag, backend in (("use_deepspeed", "deepspeed"), ("use_fsdp", "fsdp")):
        if getattr(dist, flag) and dist.backend != backend:
            problems.append(
                Problem(
                    f"distributed.{flag}",
                    f"{flag} is true but backend is {dist.backend}.",
                    f"set backend: {backend}, or drop {flag}.",
                )
            )
    if dist.fsdp and dist.backend != "fsdp":
        problems.append(
            Problem(
                "distributed.fsdp",
                f"FSDP settings are given but backend is {dist.backend}: they would be ignored.",
                "set backend: fsdp (or use_fsdp: true), or remove them.",
            )
        )
    if dist.fsdp and dist.fsdp_config:
        problems.append(
            Problem(
                "distributed.fsdp_config",
                "FSDP settings are given both inline and in fsdp_config.",
                "keep one: the file (fsdp_config), or the settings under distributed.",
            )
        )
    if dist.backend == "deepspeed" and not dist.deepspeed_config:
        problems.append(
            Problem(
                "distributed.deepspeed_config",
                "backend deepspeed needs a DeepSpeed file.",
                "run `distsetup deepspeed --output config/ds_config.json` and set "
                "deepspeed_config: config/ds_config.json.",
            )
        )
    for key in ("deepspeed_config", "fsdp_config"):
        value = getattr(dist, key)
        if value and base_dir is not None and not resolve_config_path(value, base_dir).exists():
            problems.append(
                Problem(
                    f"distributed.{key}",
                    f"file {value} does not exist.",
                    f"create it with `distsetup {key.split('_')[0]}` or fix the path.",
                )
            )
    if dist.backend == "fsdp" and training.precision not in TRAINER_PRECISIONS:
        problems.append(Problem("training.precision", *TRAINER_FP16_PROBLEM))
    if model.type == "gpt" and model.n_embd % model.n_head:
        problems.append(
            Problem(
                "model.n_embd",
                f"n_embd {model.n_embd} is not a multiple of n_head {model.n_head}.",
                f"use n_embd: {model.n_head * max(1, model.n_embd // model.n_head)}.",
            )
        )
    if model.type == "hf" and not model.hf_path:
        problems.append(
            Problem(
                "model.hf_path", "model type hf needs hf_path.", "point hf_path at a local folder with a config.json."
            )
        )
    problems += _python_problems(config, base_dir)
    problems += _data_problems(config, base_dir)
    if training.scale_lr != "none" and training.base_batch_size is None:
        problems.append(
            Problem(
                "training.base_batch_size",
                f"scale_lr {training.scale_lr} needs base_batch_size.",
                "set base_batch_size to the global batch size your lr was tuned for.",
            )
        )
    return problems


# (section, key, what the function it names does, the type that needs it or None)
PYTHON_REFERENCES = (
    ("model", "builder", "builds the model", "python"),
    ("data", "builder", "builds a dataset for a split", "python"),
    ("data", "collate", "makes a batch of samples", None),
    ("training", "loss", "computes a micro-batch's loss", None),
)


def names_user_code(config: RunConfig) -> bool:
    """Whether the run config names some of the user's code (model.builder, data.builder, ...)."""
    return any(getattr(getattr(config, section), key) for section, key, *_ in PYTHON_REFERENCES)


def _python_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    """The user's code named by the run config (model.builder, data.builder, data.collate, training.loss): written
    module:function, its module found (not imported: checking a file runs none of its code), and present exactly
    where its section's type needs it."""
    problems = []
    for section_name, key, role, needed_by in PYTHON_REFERENCES:
        section = getattr(config, section_name)
        where, value = f"{section_name}.{key}", getattr(section, key)
        if value is not None:
            problems += python_refs.problems(value, where, role, base_dir)
        if needed_by is None:
            continue
        if section.type == needed_by and value is None:
            problems.append(
                Problem(
                    where,
                    f"{section_name}.type python needs {key}.",
                    f"name the function that {role}: module:function.",
                )
            )
        elif section.type != needed_by and (value is not None or section.args):
            stray = key if value is not None else "args"
            problems.append(
                Problem(
                    f"{section_name}.{stray}",
                    f"{stray} is read only with {section_name}.type python (this is {section.type}).",
                    f"set {section_name}.type: python, or remove {stray}.",
                )
            )
    if config.data.collate and config.data.type != "python":
        problems.append(
            Problem(
                "data.collate",
                f"collate is read only with data.type python (token data come as blocks of ids: {config.data.type}).",
                "set data.type: python, or remove collate.",
            )
        )
    if config.data.type == "python":
        for key in ("paths", "val_paths", "val_fraction"):
            if getattr(config.data, key):
                problems.append(
                    Problem(
                        f"data.{key}",
                        f"data.type python reads its samples from data.builder, not data.{key}.",
                        f'remove {key}; data.builder is called with "val" for the validation set.',
                    )
                )
    return problems


def _data_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    data, model, training = config.data, config.model, config.training
    problems = []
    if model.tokenizer and base_dir is not None and not resolve_config_path(model.tokenizer, base_dir).is_dir():
        problems.append(
            Problem("model.tokenizer", f"folder {model.tokenizer} does not exist.", "point it at a tokenizer folder.")
        )
    if training.eval_interval and not (data.val_paths or data.val_fraction or data.type == "python"):
        problems.append(
            Problem(
                "training.eval_interval",
                "there is no validation set to evaluate.",
                "set data.val_paths or data.val_fraction, or drop eval_interval.",
            )
        )
    if data.type != "files":
        return problems
    if not data.paths:
        problems.append(
            Problem("data.paths", "data type files needs at least one path.", "list your data files under data.paths.")
        )
        return problems
    if data.val_paths and data.val_fraction:
        problems.append(Problem("data.val_fraction", "val_paths and val_fraction are both set.", "keep one of them."))
    tokens = data.paths[0].endswith(TOKEN_SUFFIX)
    for key in ("paths", "val_paths"):
        for i, name in enumerate(getattr(data, key)):
            where = f"data.{key}[{i}]"
            if not name.endswith((*TEXT_SUFFIXES, TOKEN_SUFFIX)):
                problems.append(
                    Problem(where, f"{name} is not a {', '.join(TEXT_SUFFIXES)} or {TOKEN_SUFFIX} file.", "rename it.")
                )
            elif name.endswith(TOKEN_SUFFIX) != tokens or (tokens and i > 0):
                problems.append(
                    Problem(
                        where,
                        f"{name}: a pre-tokenized .bin file is the only file of its split.",
                        "list one .bin in paths (and one in val_paths), or text files only.",
                    )
                )
            elif data.format != "text" and name.endswith(".txt"):
                problems.append(
                    Problem(
                        where, f"format {data.format} reads fields of records; {name} is plain text.", "use .jsonl."
                    )
                )
            elif not resolve_config_path(name, base_dir).is_file():
                problems.append(
                    Problem(
                        where,
                        f"file {name} does not exist.",
                        "correct the path (a relative one is read from the working directory, else next to the "
                        "config).",
                    )
                )
    if tokens and data.val_fraction:
        problems.append(
            Problem("data.val_fraction", "a pre-tokenized .bin is not split.", "name a validation .bin in val_paths.")
        )
    if data.format == "chat" and not model.tokenizer:
        problems.append(
            Problem("data.format", "format chat needs a chat template.", "set model.tokenizer to a tokenizer folder.")
        )
    return problems


def resolve_config_path(path: str, base_dir: Path | None) -> Path:
    """A file named in a run config: as given when absolute or present in the working directory, else
    next to the config (base_dir); every reader of the config resolves paths this way."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() or base_dir is None else base_dir / p


if __name__ == "__main__":
    print(json.dumps(run_config_schema(), indent=2))

"""The run config (config.yaml): one dataclass per section, each field with its documentation and its JSON Schema
constraints. `runconfig_load` reads a file into these strictly; `runconfig_rules` checks what spans fields.

The fields' metadata also yields the JSON Schema shipped as distsetup/formats/schemas/run_config.schema.json
(`python -m distsetup.formats.runconfig > distsetup/formats/schemas/run_config.schema.json` regenerates it).
"""

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from distsetup.formats.lr_scaling import RULES

BACKENDS = ("single", "ddp", "fsdp", "deepspeed")
MODEL_TYPES = ("gpt", "hf", "python")
BUILTIN_BLOCK = "Block"  # the built-in GPT's block class: what FSDP2 shards, checkpointing recomputes, compile compiles
DATA_TYPES = ("synthetic", "files", "python")
FORMATS = ("text", "prompt_completion", "chat")
# The data settings that name the fields each format reads from a record
FORMAT_FIELDS = {
    "text": ("text_field",),
    "prompt_completion": ("prompt_field", "completion_field"),
    "chat": ("messages_field",),
}
REPORTERS = ("tensorboard", "wandb")
CHECKPOINTING = ("none", "full", "selective")  # besides metrics.jsonl, which is always written
TEXT_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets' builders
TEXT_SUFFIXES = tuple(TEXT_LOADERS)
TOKEN_SUFFIX = ".bin"  # a pre-tokenized token file
DATA_SUFFIXES = (*TEXT_SUFFIXES, TOKEN_SUFFIX)  # the files data.paths take
PRECISIONS = ("fp32", "bf16", "fp16")
BUILTIN_SHAPE = ("n_layer", "n_head", "n_embd", "dropout")  # the built-in GPT's alone: the others have their own
# Upper bounds on the model's shape that no real model reaches (the largest published: about 128 layers of
# hidden size 16-25k with 128 heads, vocabularies of 256k tokens, contexts of 10M tokens); a larger value is
# a typo, and would make `distsetup plan` compute with absurd numbers or the trainer allocate without end.
# the longest collective timeout: a week (a larger one overflowed torch's timedelta, with a traceback on every rank)
MAX_TIMEOUT_MINUTES = 7 * 24 * 60
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
        f"default: the model's own (gpt: {BUILTIN_BLOCK}; hf: its _no_split_modules; python: the class of the children "
        "of its largest nn.ModuleList or nn.Sequential of one class of its own); layer_cls: X is read as [X]",
    )
    zero3_leaf_classes: list[str] = setting(
        [],
        "classes ZeRO-3 gathers whole and every backend treats as run conditionally (an MoE layer whose experts "
        "differ between ranks); found by themselves: the container of like experts where it has a forward of its "
        "own (it picks which run), else the module holding a plain nn.ModuleList/ModuleDict of them",
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
        0.0,
        "hold out this fraction of the records (drawn with training.seed) for validation; synthetic data: that "
        "fraction of num_samples generated besides",
        minimum=0,
        maximum=0.5,
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
        "keep the N newest complete checkpoints (older ones go once the step after a newer one has checked it); "
        "default all",
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
    find_unused_parameters: bool | None = setting(
        None,
        "DDP: look each step for parameters that got no gradient (a layer the model runs on some micro-batches or "
        "ranks only), as DistributedDataParallel(find_unused_parameters=True) does; default: where layers run "
        "differently per rank (MoE experts)",
    )
    use_deepspeed: bool = setting(False, "same as backend: deepspeed (the guides' spelling)")
    use_fsdp: bool = setting(False, "same as backend: fsdp (the guides' spelling)")
    timeout_minutes: float = setting(
        30,
        "collective timeout in minutes (fractions allowed); a dead rank ends the job after this; at most a week",
        exclusiveMinimum=0,
        maximum=MAX_TIMEOUT_MINUTES,
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

    def resolved(self, base_dir: Path | None) -> "RunConfig":
        """A copy with every file it names found where its readers find it (resolve_config_path: as given, else
        next to the config in `base_dir`): the backend files, the data files, the tokenizer and the HF folder."""

        def found(path: str | None) -> str | None:
            return str(resolve_config_path(path, base_dir)) if path else path

        model = dataclasses.replace(
            self.model, tokenizer=found(self.model.tokenizer), hf_path=found(self.model.hf_path)
        )
        data = dataclasses.replace(
            self.data,
            paths=[str(resolve_config_path(p, base_dir)) for p in self.data.paths],
            val_paths=[str(resolve_config_path(p, base_dir)) for p in self.data.val_paths],
        )
        distributed = dataclasses.replace(
            self.distributed,
            deepspeed_config=found(self.distributed.deepspeed_config),
            fsdp_config=found(self.distributed.fsdp_config),
        )
        return dataclasses.replace(self, model=model, data=data, distributed=distributed)


SECTIONS = {  # section name -> its dataclass, in field order
    name: cls for name, cls in typing.get_type_hints(RunConfig).items() if dataclasses.is_dataclass(cls)
}


# (section, key, what the function it names does, the section's type that needs it or None, the section's type with
# which the run reads it or None: with any)
PYTHON_REFERENCES = (
    ("model", "builder", "builds the model", "python", "python"),
    ("data", "builder", "builds a dataset for a split", "python", "python"),
    ("data", "collate", "makes a batch of samples", None, "python"),
    ("training", "loss", "computes a micro-batch's loss", None, None),
)


def names_user_code(config: RunConfig) -> bool:
    """Whether the run config names some of the user's code (model.builder, data.builder, ...)."""
    return any(getattr(getattr(config, section), key) for section, key, *_ in PYTHON_REFERENCES)


def resolve_config_path(path: str, base_dir: Path | None) -> Path:
    """A file named in a run config: as given when absolute or present in the working directory, else
    next to the config (base_dir); every reader of the config resolves paths this way."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() or base_dir is None else base_dir / p


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


if __name__ == "__main__":
    print(json.dumps(run_config_schema(), indent=2))

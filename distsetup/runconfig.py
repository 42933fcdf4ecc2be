"""The run config (config.yaml): one dataclass per section, loaded strictly, checked across fields once.

Each field's metadata also yields the JSON Schema shipped as distsetup/schemas/run_config.schema.json
(`python -m distsetup.runconfig > distsetup/schemas/run_config.schema.json` regenerates it).
"""

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from distsetup.errors import DistsetupError
from distsetup.lr_scaling import RULES
from distsetup.problems import Problem, schema_problems

BACKENDS = ("single", "ddp", "fsdp", "deepspeed")
PRECISIONS = ("fp32", "bf16", "fp16")


def setting(default, doc: str, **schema):
    """A config field with its documentation and extra JSON Schema constraints (enum, minimum, ...)."""
    kwargs = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(metadata={"doc": doc, **schema}, **kwargs)


@dataclass
class ModelConfig:
    """The model: the built-in GPT or a Hugging Face causal LM from a local folder."""

    type: str = setting("gpt", "gpt (built in) or hf (a transformers causal LM from hf_path)",
                        enum=["gpt", "hf"])
    vocab_size: int = setting(256, "vocabulary size; 256 = bytes", minimum=1)
    block_size: int = setting(64, "sequence length in tokens", minimum=2)
    n_layer: int = setting(2, "transformer blocks", minimum=1)
    n_head: int = setting(4, "attention heads per block", minimum=1)
    n_embd: int = setting(64, "hidden size; a multiple of n_head", minimum=1)
    dropout: float = setting(0.0, "dropout probability", minimum=0, maximum=1)
    hf_path: str | None = setting(None, "local folder with a config.json (and weights, if a checkpoint)")
    layer_cls: str | None = setting(None, "block class to shard and checkpoint; default: the model's own")


@dataclass
class DataConfig:
    """Training data: a synthetic task, or the user's text/JSONL files tokenised byte-level."""

    type: str = setting("synthetic", "synthetic or files", enum=["synthetic", "files"])
    paths: list[str] = setting([], "text or .jsonl files (with a 'text' field) for type: files")
    num_samples: int = setting(4096, "samples in the synthetic task", minimum=1)


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    seed: int = setting(1234, "seed for weights, data order and dropout")
    micro_batch_size: int = setting(8, "samples per process per forward pass", minimum=1)
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", minimum=1)
    max_steps: int = setting(200, "optimizer steps in the whole run", minimum=1)
    lr: float = setting(1e-3, "peak learning rate (before scaling)", exclusiveMinimum=0)
    min_lr_ratio: float = setting(0.1, "cosine decay ends at lr x this", minimum=0, maximum=1)
    warmup_steps: int = setting(20, "linear warmup steps", minimum=0)
    weight_decay: float = setting(0.01, "AdamW weight decay", minimum=0)
    betas: list[float] = setting([0.9, 0.95], "AdamW betas", minItems=2, maxItems=2)
    grad_clip: float = setting(1.0, "clip the gradient norm to this; 0 disables", minimum=0)
    precision: str = setting("fp32", "fp32, bf16 or fp16", enum=list(PRECISIONS))
    scale_lr: str = setting("none", "scale lr with the global batch: none, linear or sqrt", enum=list(RULES))
    base_batch_size: int | None = setting(None, "global batch size that lr was tuned for", minimum=1)
    activation_checkpointing: bool = setting(False, "recompute block activations in backward")
    checkpoint_interval: int = setting(50, "save every N steps (and at the end)", minimum=1)
    output_dir: str = setting("runs/demo", "checkpoints, metrics and the run summary")
    log_interval: int = setting(10, "print and log metrics every N steps", minimum=1)


@dataclass
class DistributedConfig:
    """How the run is spread over processes."""

    backend: str = setting("ddp", "single, ddp, fsdp or deepspeed", enum=list(BACKENDS))
    deepspeed_config: str | None = setting(None, "DeepSpeed JSON (backend: deepspeed)")
    fsdp_config: str | None = setting(None, "FSDP JSON (backend: fsdp); default: full shard of each block")
    use_deepspeed: bool = setting(False, "same as backend: deepspeed (the guides' spelling)")
    use_fsdp: bool = setting(False, "same as backend: fsdp (the guides' spelling)")
    timeout_minutes: int = setting(30, "collective timeout; a dead rank ends the job after this", minimum=1)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}


def run_config_schema() -> dict:
    """The JSON Schema of config.yaml, derived from the dataclasses above."""
    sections = {name: _section_schema(cls) for name, cls in SECTIONS.items()}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "distsetup run config",
            "type": "object", "additionalProperties": False, "properties": sections}


def _section_schema(cls) -> dict:
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        extra = {k: v for k, v in f.metadata.items() if k != "doc"}
        props[f.name] = {"description": f.metadata["doc"], **_json_type(hints[f.name]), **extra}
    return {"type": "object", "description": cls.__doc__, "additionalProperties": False, "properties": props}


def _json_type(hint) -> dict:
    names = {int: "integer", float: "number", bool: "boolean", str: "string"}
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return {"type": "array", "items": {"type": names[args[0]]}}
    if type(None) in args:
        return {"type": [names[a] for a in args if a is not type(None)] + ["null"]}
    return {"type": names[hint]}


class _Loader(yaml.SafeLoader):
    """YAML as users write it: `3e-4` is a float (PyYAML's YAML 1.1 rules read it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789."))


def parse_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` overrides (values parsed as YAML) to a raw config dict."""
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.partition(".")
        if not (sep and dot and key):
            raise DistsetupError(f"override '{item}' is not of the form section.key=value.",
                                 "write e.g. training.lr=3e-4")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise DistsetupError(f"override '{item}': '{section}' is not a section.",
                                 f"sections are {', '.join(SECTIONS)}.")
        try:
            raw[section][key] = parse_yaml(value)
        except yaml.YAMLError:
            raise DistsetupError(f"override '{item}': the value is not valid YAML.",
                                 f"quote it: {dotted}='\"...\"' (a path or a string).")
    return raw


def read_yaml(path: Path) -> dict:
    try:
        raw = parse_yaml(path.read_text()) or {}
    except OSError as e:
        raise DistsetupError(f"cannot read run config {path}: {e.strerror}.", "check the --config path.")
    except UnicodeDecodeError:
        raise DistsetupError(f"run config {path} is not UTF-8 text.", "give the YAML run config itself.")
    except yaml.YAMLError as e:
        raise DistsetupError(f"{path} is not valid YAML: {str(e).splitlines()[0]}.", "fix the YAML syntax.")
    if not isinstance(raw, dict):
        raise DistsetupError(f"{path} must hold a mapping of sections.", "start with e.g. 'training:'.")
    return raw


def config_problems(raw: dict, base_dir: Path | None = None) -> list[Problem]:
    """Every problem in a raw run config: schema (unknown keys, types, ranges), then cross-field rules."""
    problems = schema_problems(raw, "run_config")
    if problems:
        return problems
    return _cross_field_problems(_build(raw), base_dir)


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read config.yaml (or the defaults when path is None), apply overrides, and check it all."""
    raw = read_yaml(Path(path)) if path else {}
    raw = apply_overrides(raw, list(overrides))
    problems = config_problems(raw, Path(path).parent if path else None)
    if problems:
        where = f" in {path}" if path else ""
        raise DistsetupError(f"run config problem{where}: {problems[0]}"
                             + (f" (and {len(problems) - 1} more; run `distsetup validate`)" if len(problems) > 1 else ""))
    return _build(raw)


def backend_of(distributed: dict) -> str:
    """The backend a raw `distributed` section selects: an explicit backend, else the guides' keys."""
    if "backend" in distributed:
        return distributed["backend"]
    if distributed.get("use_deepspeed") is True:
        return "deepspeed"
    return "fsdp" if distributed.get("use_fsdp") is True else DistributedConfig.backend


def _build(raw: dict) -> RunConfig:
    sections = {name: cls(**raw.get(name, {})) for name, cls in SECTIONS.items()}
    config = RunConfig(**sections)
    config.distributed.backend = backend_of(raw.get("distributed", {}))
    return config


def _cross_field_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    problems = []
    dist, model, training = config.distributed, config.model, config.training
    if dist.use_deepspeed and dist.use_fsdp:
        problems.append(Problem("distributed", "use_deepspeed and use_fsdp are both true.",
                                "choose one: backend: deepspeed or backend: fsdp."))
    for flag, backend in (("use_deepspeed", "deepspeed"), ("use_fsdp", "fsdp")):
        if getattr(dist, flag) and dist.backend != backend:
            problems.append(Problem(f"distributed.{flag}", f"{flag} is true but backend is {dist.backend}.",
                                    f"set backend: {backend}, or drop {flag}."))
    if dist.backend == "deepspeed" and not dist.deepspeed_config:
        problems.append(Problem("distributed.deepspeed_config", "backend deepspeed needs a DeepSpeed file.",
                                "run `distsetup deepspeed --output config/ds_config.json` and set "
                                "deepspeed_config: config/ds_config.json."))
    for key in ("deepspeed_config", "fsdp_config"):
        value = getattr(dist, key)
        if value and base_dir is not None and not resolve_config_path(value, base_dir).exists():
            problems.append(Problem(f"distributed.{key}", f"file {value} does not exist.",
                                    f"create it with `distsetup {key.split('_')[0]}` or fix the path."))
    if model.type == "gpt" and model.n_embd % model.n_head:
        problems.append(Problem("model.n_embd", f"n_embd {model.n_embd} is not a multiple of n_head {model.n_head}.",
                                f"use n_embd: {model.n_head * max(1, model.n_embd // model.n_head)}."))
    if model.type == "hf" and not model.hf_path:
        problems.append(Problem("model.hf_path", "model type hf needs hf_path.",
                                "point hf_path at a local folder with a config.json."))
    if config.data.type == "files" and not config.data.paths:
        problems.append(Problem("data.paths", "data type files needs at least one path.",
                                "list your .txt or .jsonl files under data.paths."))
    if training.scale_lr != "none" and training.base_batch_size is None:
        problems.append(Problem("training.base_batch_size", f"scale_lr {training.scale_lr} needs base_batch_size.",
                                "set base_batch_size to the global batch size your lr was tuned for."))
    return problems


def resolve_config_path(path: str, base_dir: Path | None) -> Path:
    """A file named in a run config: as given when absolute or present in the working directory, else
    next to the config (base_dir); every reader of the config resolves paths this way."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() or base_dir is None else base_dir / p


if __name__ == "__main__":
    print(json.dumps(run_config_schema(), indent=2))

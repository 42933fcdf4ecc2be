"""The run config's rules that span fields, checked once at load time on the built RunConfig: the backend and its
files, the model's shape (a Hugging Face model's from its config.json), the user's code it names, the data files, the
lr scaling."""

import json
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats import python_refs
from distsetup.formats.default_paths import BACKEND_FILES
from distsetup.formats.fsdp import TRAINER_FP16_PROBLEM, TRAINER_PRECISIONS
from distsetup.formats.problems import Problem
from distsetup.formats.reading import read_json
from distsetup.formats.runconfig import (
    DATA_SUFFIXES,
    FORMAT_FIELDS,
    PYTHON_REFERENCES,
    TEXT_SUFFIXES,
    TOKEN_SUFFIX,
    DataConfig,
    RunConfig,
    resolve_config_path,
)


def cross_field_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    """Every rule across fields the config breaks; `base_dir`: its folder, where the files it names are looked
    for (None: not looked for)."""
    return (
        _backend_problems(config, base_dir)
        + _model_problems(config)
        + _hf_folder_problems(config, base_dir)
        + _python_problems(config, base_dir)
        + _data_problems(config, base_dir)
        + _lr_problems(config)
    )


def step_count_problems(raw: dict) -> list[Problem]:
    """epochs and max_steps both written (read from the raw file: max_steps always has a default; epochs: null is
    unset)."""
    training = raw.get("training") or {}
    if training.get("epochs") is not None and "max_steps" in training:
        return [Problem("training.epochs", "epochs and max_steps are both set.", "keep one of them.")]
    return []


def _backend_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    """The backend, the keys that choose it, its file or inline settings, and the precision it can train in."""
    problems = []
    dist, training = config.distributed, config.training
    if dist.use_deepspeed and dist.use_fsdp:
        problems.append(
            Problem(
                "distributed",
                "use_deepspeed and use_fsdp are both true.",
                "choose one: backend: deepspeed or backend: fsdp.",
                involves=("distributed.use_deepspeed", "distributed.use_fsdp"),
            )
        )
    for flag, backend in (("use_deepspeed", "deepspeed"), ("use_fsdp", "fsdp")):
        if getattr(dist, flag) and dist.backend != backend:
            problems.append(
                Problem(
                    f"distributed.{flag}",
                    f"{flag} is true but backend is {dist.backend}.",
                    f"set backend: {backend}, or drop {flag}.",
                    involves=("distributed.backend",),
                )
            )
    if dist.fsdp and dist.backend != "fsdp":
        problems.append(
            Problem(
                "distributed.fsdp",
                f"FSDP settings are given but backend is {dist.backend}: they would be ignored.",
                "set backend: fsdp (or use_fsdp: true), or remove them.",
                involves=("distributed.backend",),
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
                f"run `distsetup deepspeed --output {BACKEND_FILES['deepspeed']}` and set "
                f"deepspeed_config: {BACKEND_FILES['deepspeed']}.",
                involves=("distributed.backend",),
            )
        )
    for key in ("deepspeed_config", "fsdp_config"):
        value = getattr(dist, key)
        if value and base_dir is not None and not resolve_config_path(value, base_dir).exists():
            problems.append(
                Problem(
                    f"distributed.{key}",
                    f"file {value} does not exist.",
                    missing_file_fix(key),
                )
            )
    if dist.backend == "fsdp" and training.precision not in TRAINER_PRECISIONS:
        problems.append(Problem("training.precision", *TRAINER_FP16_PROBLEM))
    return problems


def _model_problems(config: RunConfig) -> list[Problem]:
    """The built-in model's heads divide its hidden size; a Hugging Face model has its folder."""
    model = config.model
    problems = []
    if model.type == "gpt" and model.n_embd % model.n_head:
        problems.append(
            Problem(
                "model.n_embd",
                f"n_embd {model.n_embd} is not a multiple of n_head {model.n_head}.",
                f"use n_embd: {model.n_head * max(1, model.n_embd // model.n_head)}.",
                involves=("model.n_head",),
            )
        )
    if model.type == "hf" and not model.hf_path:
        problems.append(
            Problem(
                "model.hf_path", "model type hf needs hf_path.", "point hf_path at a local folder with a config.json."
            )
        )
    return problems


# The keys of a Hugging Face config.json that say its longest sequence (GPT-2's learned positions: n_positions, n_ctx)
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")

# Text encoder-decoders of which transformers (5.23) builds no causal LM (AutoModelForCausalLM): the trainer refuses
# them on every rank, and validate says it first from config.json. BART, mBART, Marian, Pegasus and the like have a
# causal LM (their decoder), which the trainer builds: not here.
NO_CAUSAL_LM = frozenset(
    {"t5", "mt5", "umt5", "longt5", "switch_transformers", "t5gemma", "t5gemma2", "led", "m2m_100", "nllb-moe"}
    | {"fsmt", "pegasus_x", "encoder-decoder", "udop", "pix2struct"}
)


def no_causal_lm(hf_config: dict, folder: str) -> tuple[str, str] | None:
    """(the problem, its fix) where a Hugging Face `folder`'s config.json describes an encoder-decoder of which
    transformers builds no causal LM; None for any other."""
    if hf_config.get("is_encoder_decoder") is not True or hf_config.get("model_type") not in NO_CAUSAL_LM:
        return None
    return (
        f"{folder} holds an encoder-decoder ({hf_config['model_type']}); model.type hf trains causal LMs "
        "(AutoModelForCausalLM).",
        "train it as model.type python: a builder that returns the model, and its own .loss (docs/own-code.md).",
    )


def _hf_folder_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    """A Hugging Face model's folder has its config.json, describes a causal LM, and model.block_size fits in the
    positions it says (a longer sample runs off learned position embeddings: an IndexError on every rank)."""
    model = config.model
    if model.type != "hf" or not model.hf_path or base_dir is None:
        return []
    described = resolve_config_path(model.hf_path, base_dir) / "config.json"
    if not described.is_file():
        return [
            Problem(
                "model.hf_path",
                f"{model.hf_path} has no config.json.",
                "point hf_path at a folder save_pretrained wrote (config.json, and weights if it is a checkpoint).",
            )
        ]
    try:
        hf_config = read_json(described)
    except DistsetupError as e:
        return [Problem("model.hf_path", e.message, "fix or rewrite its config.json.")]
    if said := no_causal_lm(hf_config, model.hf_path):
        return [Problem("model.hf_path", *said)]
    if (found := hf_positions(hf_config)) and model.block_size > found[1]:
        key, positions = found
        return [
            Problem(
                "model.block_size",
                f"{model.block_size} is above the model's {key}, {positions} (its config.json): its positions end "
                "there.",
                f"use block_size: {positions} or less, or raise {key} in its config.json.",
            )
        ]
    return []


def hf_positions(hf_config: dict) -> tuple[str, int] | None:
    """The longest sequence a Hugging Face config.json allows and the key that says it, if one does (`distsetup
    init` takes its block size within it, validate and the trainer refuse a longer one)."""
    for key in POSITIONS:
        value = hf_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return key, value
    return None


def _lr_problems(config: RunConfig) -> list[Problem]:
    """Scaling the lr needs the batch it was tuned at; AdamW's betas are each in [0, 1) (torch refuses others when
    it builds the optimizer, on every rank)."""
    training = config.training
    problems = []
    if training.scale_lr != "none" and training.base_batch_size is None:
        problems.append(
            Problem(
                "training.base_batch_size",
                f"scale_lr {training.scale_lr} needs base_batch_size.",
                "set base_batch_size to the global batch size your lr was tuned for.",
                involves=("training.scale_lr",),
            )
        )
    if not all(0 <= beta < 1 for beta in training.betas):
        problems.append(Problem("training.betas", f"{training.betas} are not both in [0, 1).", "e.g. [0.9, 0.95]."))
    return problems


def _python_problems(config: RunConfig, base_dir: Path | None) -> list[Problem]:
    """The user's code named by the run config (model.builder, data.builder, data.collate, training.loss): written
    module:function, its module found (not imported: checking a file runs none of its code), and present exactly
    where its section's type needs it."""
    problems = []
    for section_name, key, role, needed_by, read_with in PYTHON_REFERENCES:
        section = getattr(config, section_name)
        where, value = f"{section_name}.{key}", getattr(section, key)
        # a reference the run never reads is a stray (below), whether its module exists or not
        if value is not None and (read_with is None or section.type == read_with):
            args = section.args if key == "builder" else None  # the builders take the section's args
            problems += python_refs.problems(value, where, role, base_dir, args)
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
    """The tokenizer and validation set the data need; for data files, that they are given and split one way."""
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
    problems += data_file_problems(data, base_dir)
    if tokens and data.val_fraction:
        problems.append(
            Problem("data.val_fraction", "a pre-tokenized .bin is not split.", "name a validation .bin in val_paths.")
        )
    if data.format == "chat" and not model.tokenizer:
        problems.append(
            Problem("data.format", "format chat needs a chat template.", "set model.tokenizer to a tokenizer folder.")
        )
    return problems


def data_file_problems(data: DataConfig, base_dir: Path | None) -> list[Problem]:
    """Each data file: a text or token file, a .bin alone in its split (where the first is a .bin), plain text only
    for format text, present, and a .jsonl's first record holding the fields its format reads."""
    tokens, problems = bool(data.paths) and data.paths[0].endswith(TOKEN_SUFFIX), []
    for key in ("paths", "val_paths"):
        for i, name in enumerate(getattr(data, key)):
            where = f"data.{key}[{i}]"
            if not name.endswith(DATA_SUFFIXES):
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
            elif name.endswith(".jsonl"):
                problems += first_record_problems(resolve_config_path(name, base_dir), where, data)
    return problems


FIRST_RECORD_BYTES = 1 << 20  # a record longer than this is read by the trainer alone


def first_record_problems(path: Path, where: str, data: DataConfig) -> list[Problem]:
    """The fields data.format reads, each in the first record of a .jsonl file (the trainer stops at the first record
    without one, after the process group and before torchrun's own failure block: said here before any start)."""
    try:
        with path.open("rb") as f:  # line by line: a shard on a network file system is read no further than its record
            line = b""
            while not line.strip() and f.tell() < FIRST_RECORD_BYTES:
                line = f.readline(FIRST_RECORD_BYTES)
                if not line:
                    break
        record = json.loads(line) if line.strip() else None
    except (OSError, ValueError):
        return []  # unreadable or cut short: the trainer says what it finds
    if not isinstance(record, dict):
        return []
    for setting in FORMAT_FIELDS[data.format]:
        field = getattr(data, setting)
        if record.get(field) is None:  # the trainer reads a null as no field
            fields = ", ".join(str(key) for key in record) or "none"
            return [
                Problem(
                    where,
                    f"{path.name}: its first record has no field '{field}' that format {data.format} reads (its "
                    f"fields: {fields}).",
                    f"name the field with data.{setting}, or write '{field}' in every record.",
                )
            ]
    return []


WRITTEN_BY = {"deepspeed_config": "distsetup deepspeed", "fsdp_config": "distsetup fsdp"}  # by distributed.* key


def missing_file_fix(key: str) -> str:
    """The fix for a distributed.`key` file that does not exist (or the flag that names it)."""
    return f"create it with `{WRITTEN_BY[key]}` or fix the path."

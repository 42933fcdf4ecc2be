"""The newest complete checkpoint of any backend and world size as consolidated weights: a .pt for
`train.py --export`, or with `distsetup checkpoint export` model.safetensors and model.json, or a Hugging Face
folder; the last two are written one tensor at a time (training/checkpoint/weight_stream.py)."""

import contextlib
import errno
import json
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from distsetup.errors import DistsetupError, first_line, last_line
from distsetup.formats.checkpoint_folder import (
    MARKER,
    WITHDRAWN,
    Marker,
    checkpoints_folder,
    damage,
    find_resume,
    one_step_folder,
    passed_over,
)
from distsetup.formats.runconfig import BUILTIN_SHAPE
from distsetup.training.checkpoint.files import and_dcp_failures, atomic_save
from distsetup.training.checkpoint.named_state import weight_stream
from distsetup.training.checkpoint.safetensors_file import write_safetensors
from distsetup.training.checkpoint.weight_stream import WeightStream
from distsetup.training.model.build import require_transformers
from distsetup.training.staged_folders import as_a_new_folder

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def consolidated_state_dict(path: Path) -> dict:
    """The full fp32 model state dict of checkpoint folder `path`, whatever backend wrote it, all in memory."""
    return {name: tensor.clone() for name, tensor in weight_stream(path).tensors()}


def newest_checkpoint(checkpoints: Path) -> Path:
    """The newest intact checkpoint under `checkpoints` (a run's checkpoints/), each newer damaged one passed over in
    a line, as the trainer says it; or `checkpoints` itself where it is one step's folder (step_N, its marker in it),
    as DeepSpeed's and the HF Trainer's users name a checkpoint."""
    step = one_step_folder(checkpoints)
    if step is not None and (checkpoints / WITHDRAWN).is_file():
        reason = (checkpoints / WITHDRAWN).read_text().strip()
        raise DistsetupError(
            f"checkpoint {checkpoints} was withdrawn: {reason}.", "name the run's folder, for the newest complete one."
        )
    if step is not None and (checkpoints / MARKER).is_file():
        if problem := damage(checkpoints, step):
            raise DistsetupError(
                f"checkpoint {checkpoints} is damaged: {problem}.", "name another step_N folder, or the run's folder."
            )
        return checkpoints
    path, damaged = find_resume(checkpoints)
    for problem in damaged:
        print(passed_over(problem), file=sys.stderr)
    if path is None:
        raise DistsetupError(
            f"no complete checkpoint under {checkpoints}.",
            "train first, or name the run's output_dir (or one of its checkpoints/step_N folders).",
        )
    return path


def exported_dtype(kind: torch.dtype, dtype: str) -> torch.dtype:
    """What a tensor of `kind` is exported as: floating point in the export's dtype (fp32 or bf16), others as is."""
    return EXPORT_DTYPES[dtype] if kind.is_floating_point else kind


def weights_as(path: Path, dtype: str) -> dict:
    """The consolidated weights of checkpoint folder `path`, floating-point tensors in `dtype` (fp32 or bf16)."""
    return {k: v.to(exported_dtype(v.dtype, dtype)) for k, v in consolidated_state_dict(path).items()}


def _entries(stream: WeightStream, dtype: str) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, shape, dtype as written) of each tensor."""
    return [(name, shape, exported_dtype(kind, dtype)) for name, (shape, kind) in stream.shapes.items()]


def export_weights(checkpoints: Path, out: Path, dtype: str) -> tuple[Path, int]:
    """Write the newest complete checkpoint's weights to `out`; returns (checkpoint used, tensors written)."""
    path = newest_checkpoint(checkpoints)
    state = weights_as(path, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(state, out)
    return path, len(state)


def described(model: dict) -> dict:
    """The run config's model section as model.json shows it: the built-in GPT's shape only for the built-in GPT (a
    python or Hugging Face model's shape is its builder's or its config.json's, not these defaults)."""
    return {key: value for key, value in model.items() if model.get("type") == "gpt" or key not in BUILTIN_SHAPE}


def export_safetensors(run: Path, out: Path, dtype: str) -> tuple[Path, int]:
    """The newest complete checkpoint of `run` (any backend, any world size) as a folder `out` holding
    model.safetensors and model.json (the run config's model section, with which the trainer rebuilds it);
    written whole into a new folder or not at all, one tensor at a time. Returns (checkpoint used, tensors)."""
    path, model = checkpoint_and_model(run, out)
    with read_errors(path, "export"):
        stream = weight_stream(path)
    entries = _entries(stream, dtype)

    def write(folder: Path) -> None:
        metadata = {"format": "pt", "dtype": dtype}
        write_safetensors(folder / "model.safetensors", entries, stream.tensors(), metadata)
        (folder / "model.json").write_text(json.dumps(described(model), indent=2) + "\n")

    with read_errors(path, "export"):
        write_new_folder(out, write)
    return path, len(entries)


# what a Hugging Face model folder holds besides its weights, copied as they are
HF_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def export_hf(run: Path, out: Path, dtype: str, max_shard_size: str, hf_path: Path | None = None) -> tuple[Path, int]:
    """The newest complete checkpoint of an `hf` run as a Hugging Face folder that `from_pretrained` loads:
    config.json (the model folder's, with the exported dtype), the tokenizer and generation files it holds, and
    the weights sharded as `save_pretrained` shards them (model.safetensors, or numbered shards and an index
    above `max_shard_size`). Written whole into a new folder or not at all. `hf_path`: the model folder where it is
    now (default: the run's model.hf_path)."""
    require_transformers()
    from huggingface_hub import split_torch_state_dict_into_shards
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if parse_size_to_int(max_shard_size) <= 0:
            raise ValueError
    except ValueError:
        raise DistsetupError(f"--max_shard_size {max_shard_size} is not a size.", "write e.g. 5GB or 500MB.") from None
    path, model = checkpoint_and_model(run, out)
    if model.get("type") != "hf":
        held = "the built-in GPT" if model.get("type") == "gpt" else f"model.builder {model.get('builder')}'s model"
        raise DistsetupError(
            f"{path} holds {held}; --format hf is for Hugging Face models (model.type hf).",
            "export it without --format hf (model.safetensors with its own parameter names, and model.json).",
        )
    source = hf_path or Path(model["hf_path"])
    if not (source / "config.json").is_file():
        given = f"--hf_path {source}" if hf_path else f"model.hf_path {source} of the run"
        raise DistsetupError(
            f"{given} has no config.json here.",
            "give the model folder the run trained, where it is now"
            + ("." if hf_path else ", with --hf_path (a relative model.hf_path is read from this folder)."),
        )
    with read_errors(path, "export"):
        config = json.loads((source / "config.json").read_text())
        stream = weight_stream(path)
        order, tied = _saved_names(source)
    config["dtype"] = str(EXPORT_DTYPES[dtype]).removeprefix("torch.")  # transformers 5's key; 4.x read torch_dtype
    config.pop("torch_dtype", None)
    entries = [entry for entry in _entries(stream, dtype) if entry[0] not in tied]
    entries.sort(key=lambda entry: order.get(entry[0], len(order)))  # the order save_pretrained fills its shards in
    # sharded by huggingface_hub's rule, the one save_pretrained uses, from sizes alone (tensors on "meta")
    split = split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=kind, device="meta") for name, shape, kind in entries},
        max_shard_size=max_shard_size,
    )
    by_name = {entry[0]: entry for entry in entries}

    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in HF_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
        for filename, names in split.filename_to_tensors.items():
            shard = [by_name[name] for name in names]
            write_safetensors(folder / filename, shard, stream.tensors(names), {"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    with read_errors(path, "export"):
        write_new_folder(out, write)
    return path, len(entries)


def _saved_names(source: Path) -> tuple[dict[str, int], set[str]]:
    """For the model `source`'s config.json describes (built on the meta device: no memory, nothing downloaded):
    each weight's place in the state dict save_pretrained shards for a model loaded with from_pretrained
    (transformers 5 sorts the names as dotted paths, numbers in order; 4 keeps the model's order), and the tied
    names it leaves out (a second name of a parameter: from_pretrained ties it again)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source, local_files_only=True))
    names = list(model.state_dict())
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        pass
    else:
        names.sort(key=dot_natural_key)
    return {name: place for place, name in enumerate(names)}, tied


def checkpoint_and_model(run: Path, out: Path) -> tuple[Path, dict]:
    """The newest complete checkpoint of `run` and the model section its marker stores; `out` must be new."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DistsetupError(f"-o {out} exists and is not an empty folder.", "name a new folder.")
    path = newest_checkpoint(checkpoints_folder(run))
    model = Marker.read(path).model
    if not isinstance(model, dict):
        raise DistsetupError(
            f"{path} does not say which model it holds (written before distsetup stored it).",
            "use `python -m distsetup.train --config CONFIG --export OUT.pt` for it.",
        )
    return path, model


@contextlib.contextmanager
def read_errors(path: Path, verb: str):
    """Whatever a damaged checkpoint (or model folder) makes torch, DCP, DeepSpeed or transformers raise while
    we `verb` it, as one line."""
    try:
        yield
    except DistsetupError:
        raise
    except and_dcp_failures(Exception) as e:
        raise DistsetupError(
            f"cannot {verb} checkpoint {path}: {last_line(e)}.",
            f"move {path} aside to {verb} the checkpoint before it.",
        ) from None


def write_new_folder(out: Path, write) -> None:
    """`write(folder)` into a staging folder beside `out`, renamed to `out` once whole (with the permissions a new
    folder gets, not mkdtemp's owner-only ones); removed on any failure, Ctrl-C and SIGTERM (a scheduler's kill)
    included."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    except OSError as e:
        raise _cannot_write(out, e) from None
    try:
        with _sigterm_as_exit():
            write(staging)
            as_a_new_folder(staging)
            if out.is_dir():
                out.rmdir()
            staging.rename(out)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError) and _of_the_output(e, staging, out):
            raise _cannot_write(out, e) from None
        raise


# errors of writing whatever the file: the output's disk, not the checkpoint read
_WRITING_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _of_the_output(error: OSError, staging: Path, out: Path) -> bool:
    """Whether `error` is the output's (its folder, or the disk it is written on) rather than the checkpoint's."""
    named = [Path(name) for name in (error.filename, error.filename2) if name]
    return error.errno in _WRITING_ERRORS or any(path.is_relative_to(p) for path in named for p in (staging, out))


def _cannot_write(out: Path, error: OSError) -> DistsetupError:
    """Said of -o, not of the checkpoint (read_errors' "move the checkpoint aside" would move a good one)."""
    return DistsetupError(
        f"cannot write -o {out}: {error.strerror}.", "choose an -o in a folder you can write to, with room for it."
    )


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM raises SystemExit(143) meanwhile, so that what is half-written is removed as on Ctrl-C (its default
    action ends the process on the spot). Only the main thread may set a handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_143(signum, frame):
    raise SystemExit(128 + signal.SIGTERM)


def _exported(path: str, shapes_only: bool) -> dict[str, torch.Tensor]:
    """--init_from's tensors: a torch.save file mapped, or a safetensors file's read (`shapes_only`: tensors on the
    meta device, for a model that takes no values)."""
    if not path.endswith(".safetensors"):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        if shapes_only:
            return {name: torch.empty(f.get_slice(name).get_shape(), device="meta") for name in f.keys()}
        return {name: f.get_tensor(name) for name in f.keys()}


def load_weights(model: torch.nn.Module, path: str, state: Mapping[str, torch.Tensor] | None = None) -> None:
    """--init_from: an exported file (--export's, or `checkpoint export`'s model.safetensors) into a freshly built
    model (strict: every key must match). Mapped, not read: a model on the meta device (a rank that FSDP2 fills from
    rank 0) only checks the keys. `state`: the file, already mapped by the caller (its reader of slices), so that it
    is not mapped twice."""
    if state is None:
        try:
            state = _exported(path, shapes_only=all(p.is_meta for p in model.parameters()))
        except Exception as e:  # OSError, or whatever unpickling a file that is not a torch.save makes raise
            raise DistsetupError(
                f"cannot load --init_from {path}: {first_line(e)}.", "pass a file written by --export."
            )
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DistsetupError(f"--init_from {path} holds no state dict of tensors.", "pass a file written by --export.")
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    other_shapes = [
        f"{k} of shape {list(state[k].shape)}, the model's {list(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or other_shapes:
        found = f"missing {missing[:3]}, unexpected {unexpected[:3]}" if missing or unexpected else other_shapes[0]
        raise DistsetupError(
            f"--init_from {path} does not fit the model ({found}).", "use the run config the export was trained with."
        )
    if not all(p.is_meta for p in model.parameters()):  # a rank FSDP2 or ZeRO-3 fills from rank 0 has none to take
        model.load_state_dict(state, strict=False)

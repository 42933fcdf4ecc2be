"""One consolidated weights file from the newest complete checkpoint of any backend."""

import json
import shutil
import tempfile
from pathlib import Path

import torch

from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import checkpoints_folder, latest_complete, read_meta
from distsetup.training.checkpoint import atomic_save

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)


def consolidated_state_dict(path: Path) -> dict:
    """The full fp32 model state dict of checkpoint folder `path`, whatever backend wrote it."""
    meta = read_meta(path)
    backend = meta["backend"]
    if backend in ("single", "ddp"):
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)["model"]
    elif backend == "fsdp" and (path / "full_state.pt").exists():
        state = torch.load(path / "full_state.pt", map_location="cpu", weights_only=False)["model"]
    elif backend == "fsdp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path / "model", Path(tmp) / "model.pt")
            state = torch.load(Path(tmp) / "model.pt", map_location="cpu", weights_only=False)
    elif meta.get("zero_stage"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    else:  # ZeRO-0 keeps the whole module in the model-states file
        state = torch.load(path / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    return {_strip(k): v for k, v in state.items()}


def _strip(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key


def newest_checkpoint(checkpoints: Path) -> Path:
    path = latest_complete(checkpoints)
    if path is None:
        raise DistsetupError(
            f"no complete checkpoint under {checkpoints}.", "train first, or check training.output_dir."
        )
    return path


def weights_as(path: Path, dtype: str) -> dict:
    """The consolidated weights of checkpoint folder `path`, floating-point tensors in `dtype` (fp32 or bf16)."""
    target = EXPORT_DTYPES[dtype]
    return {k: v.to(target) if v.is_floating_point() else v for k, v in consolidated_state_dict(path).items()}


def export_weights(checkpoints: Path, out: Path, dtype: str) -> tuple[Path, int]:
    """Write the newest complete checkpoint's weights to `out`; returns (checkpoint used, tensors written)."""
    path = newest_checkpoint(checkpoints)
    state = weights_as(path, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(state, out)
    return path, len(state)


def export_safetensors(run: Path, out: Path, dtype: str) -> tuple[Path, int]:
    """The newest complete checkpoint of `run` (any backend, any world size) as a folder `out` holding
    model.safetensors and model.json (the run config's model section, with which the trainer rebuilds it);
    written whole into a new folder or not at all. Returns (checkpoint used, tensors written)."""
    from safetensors.torch import save_file

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DistsetupError(f"-o {out} exists and is not an empty folder.", "name a new folder.")
    path = newest_checkpoint(checkpoints_folder(run))
    model = read_meta(path).get("model")
    if not isinstance(model, dict):
        raise DistsetupError(
            f"{path} does not say which model it holds (written before distsetup stored it).",
            "use `python -m distsetup.train --config CONFIG --export OUT.pt` for it.",
        )
    # clone: tied weights share storage, which safetensors refuses to write twice
    state = {k: v.contiguous().clone() for k, v in weights_as(path, dtype).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt", "dtype": dtype})
        (staging / "model.json").write_text(json.dumps(model, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path, len(state)


def load_weights(model: torch.nn.Module, path: str) -> None:
    """--init_from: an exported file into a freshly built model (strict: every key must match)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # OSError, or whatever unpickling a file that is not a torch.save makes raise
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistsetupError(f"cannot load --init_from {path}: {detail}.", "pass a file written by --export.")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DistsetupError(f"--init_from {path} holds no state dict of tensors.", "pass a file written by --export.")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DistsetupError(
            f"--init_from {path} does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]}).",
            "use the run config the export was trained with.",
        )

"""DeepSpeed's universal checkpoint folder: what its ds_to_universal writes and ZeRO 1-3 engines load at any world
size and stage (`checkpoint.load_universal`). A DeepSpeed run resumes another world size or ZeRO stage through one
(`from_deepspeed`: DeepSpeed's own ds_to_universal), and any other backend's checkpoint as a named state
(named_state.py) written as one (`write`); `distsetup checkpoint convert --to deepspeed` writes one too.

The layout (DeepSpeed 0.19): zero/<parameter name>/ holds fp32.pt, exp_avg.pt and exp_avg_sq.pt, each
{"param": the whole tensor}, and step.pt; zero/optimizer_state.pt the param groups' settings and the loss scaler;
the model-states file the scheduler, the step counters, the parameters' shapes (param_shapes) and the names that
share a parameter (tied weights), and the module's buffers. distsetup's universal folders name parameters
without what wrappers add (activation checkpointing), and the engine loads them under those names. A universal
load restores parameters and optimizer state only (a DeepSpeed run keeps the buffers its model was built with;
backends/deepspeed.py sets the fp16 loss scale after it); the torch backends read the buffers too.
"""

import argparse
import contextlib
import functools
import io
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from distsetup.errors import DistsetupError, last_line
from distsetup.formats.checkpoint_folder import Marker
from distsetup.training.checkpoint import loss_scale
from distsetup.training.checkpoint.streamed_io import Lazy, read, shape_and_dtype, storage_identity
from distsetup.training.checkpoint.zero_files import MODEL_STATES, MOMENTS, buffers
from distsetup.training.model.blocks import plain_name
from distsetup.training.world import barrier, decided_by_rank0

PREFIX = ".universal-"  # the hidden folder of output_dir a conversion writes, removed once loaded


def converted_on_rank0(path: Path, write) -> Path:
    """Rank 0 calls `write(folder)` to fill a new hidden folder of output_dir with checkpoint `path` in universal
    form (the source untouched); every rank gets that folder, or the same one-line error."""

    def convert() -> Path | str:
        root = None
        try:
            root = Path(tempfile.mkdtemp(dir=path.parent.parent, prefix=PREFIX))  # in output_dir
            write(root / path.name)
        except Exception as e:  # a damaged checkpoint, a full or read-only disk: one line on every rank
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
            return f"cannot convert checkpoint {path} to DeepSpeed's universal format: {last_line(e)}."
        return root / path.name

    converted = decided_by_rank0(convert)
    if isinstance(converted, str):  # rank 0's error, raised on every rank
        raise DistsetupError(converted, f"move {path} aside to resume from the one before, or --no_resume.")
    return converted


def remove_stale(output_dir: Path) -> None:
    """Rank 0 of the run that holds `output_dir`: the hidden folders a conversion left there (a run killed while
    converting, or whose load failed)."""
    for stale in output_dir.glob(f"{PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def removed_after_loading(converted: Path, is_main: bool):
    """Every rank loads `converted` inside; once all have, rank 0 removes its hidden folder. After a failure it stays
    for the ranks still reading it, and the next run in this output_dir removes it (remove_stale)."""
    yield
    barrier()  # every rank has read it
    if is_main:
        shutil.rmtree(converted.parent, ignore_errors=True)


def from_deepspeed(path: Path, converted: Path) -> None:
    """DeepSpeed checkpoint folder `path` (ZeRO 1-3, any world size) as universal folder `converted`, by
    DeepSpeed's own ds_to_universal."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(
        input_folder=str(path),
        output_folder=str(converted),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # the state Megatron-DeepSpeed adds; plain engines do not save it
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
        ds_to_universal(args)
    (converted.parent / "latest_universal").unlink(missing_ok=True)  # its tag file, beside the output
    _readable_by_every_stage(converted)
    _with_plain_names(converted)


def lazy_named_state(folder: Path, groups: list[list[str]] | None) -> dict:
    """Universal folder `folder` as a named state: {"model", "optimizer", "scheduler", "scaler"}, weights and moments
    Lazy (each file read when asked for), the optimizer keyed by parameter names with AdamW's tensor step, in param
    `groups` (each a list of names) of the run that loads it (None: the weights alone), the fp16 loss scale as
    GradScaler state."""
    model_states = _model_states(folder)
    shape_of, zero = _shapes(model_states), folder / "zero"

    def lazy(name: str, key: str) -> Lazy:
        return Lazy(
            shape_of[name], torch.float32, functools.partial(_param, zero / name, key, shape_of[name]), (name, key)
        )

    model: dict[str, Lazy | torch.Tensor] = {name: lazy(name, "fp32") for name in shape_of}
    model |= {alias: lazy(source, "fp32") for alias, source in (model_states.get("shared_params") or {}).items()}
    model |= buffers(model_states)
    state = {"model": model, "optimizer": None, "scheduler": model_states["lr_scheduler"], "scaler": None}
    if groups is None:
        return state
    optimizer_state = _load(zero / "optimizer_state.pt")
    settings = optimizer_state["param_groups"]
    if len(settings) != len(groups):
        raise ValueError(f"{len(settings)} optimizer param groups, where this run has {len(groups)}")
    moments = {
        name: {
            "step": torch.tensor(float(_load(zero / name / "step.pt"))),
            **{key: lazy(name, key) for key in MOMENTS},
        }
        for name in (name for names in groups for name in names)
    }
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(settings, groups, strict=True)
    ]
    state["optimizer"] = {"state": moments, "param_groups": param_groups}
    state["scaler"] = loss_scale.from_deepspeed(optimizer_state.get("loss_scaler"))
    return state


def write(state: dict, folder: Path, marker: Marker) -> None:
    """Named state `state` of the checkpoint whose COMPLETE marker is `marker` as universal folder `folder`, one
    parameter at a time."""
    import deepspeed

    zero = folder / "zero"
    model, moments, groups = state["model"], state["optimizer"]["state"], state["optimizer"]["param_groups"]
    names = [name for group in groups for name in group["params"]]
    for name in names:
        (zero / name).mkdir(parents=True)
        torch.save({"param": read(model[name]).float()}, zero / name / "fp32.pt")
        for key in MOMENTS:
            torch.save({"param": read(moments[name][key]).float()}, zero / name / f"{key}.pt")
        torch.save(moments[name]["step"], zero / name / "step.pt")
    settings = [{**{k: v for k, v in group.items() if k != "params"}, "params": [i]} for i, group in enumerate(groups)]
    step = moments[names[0]]["step"]
    optimizer_state = {
        "param_groups": settings,
        "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": settings},
        "ds_version": deepspeed.__version__,
    }
    if state["scaler"]:
        optimizer_state |= {"loss_scaler": loss_scale.to_deepspeed(state["scaler"]), "dynamic_loss_scale": True}
    torch.save(optimizer_state, zero / "optimizer_state.pt")
    first_name = {_identity(model[name]): name for name in names}
    others = {k: v for k, v in model.items() if k not in names}
    shared = {k: first_name[_identity(v)] for k, v in others.items() if _identity(v) in first_name}
    buffers = {k: read(v) for k, v in others.items() if k not in shared}
    model_states = {
        "module": buffers,
        "buffer_names": list(buffers),
        "param_shapes": [
            {name: torch.Size(shape_and_dtype(model[name])[0]) for name in group["params"]} for group in groups
        ],
        "shared_params": shared,
        "lr_scheduler": state["scheduler"],
        "skipped_steps": 0,
        "mp_world_size": 1,
        "ds_version": deepspeed.__version__,
        **engine_counters(marker),  # which its loader reads
        "dp_world_size": marker.world_size,
    }
    for file in MODEL_STATES:
        torch.save(model_states, folder / file)


def engine_counters(marker: Marker) -> dict:
    """A DeepSpeed engine's step counters at the checkpoint whose COMPLETE marker is `marker`."""
    return {"global_steps": marker.step, "global_samples": marker.step * (marker.global_batch or 0)}


@contextlib.contextmanager
def plain_names_in(engine):
    """While a DeepSpeed `engine` loads a universal folder: its optimizer finds each parameter's files under the
    name without wrappers (the engine's own names keep activation checkpointing's)."""
    names = engine.param_names  # the dict its ZeRO optimizer holds too
    own = dict(names)
    names.update({param: plain_name(name) for param, name in own.items()})
    try:
        yield
    finally:
        names.update(own)


@contextlib.contextmanager
def no_tensor_parallel_warning():
    """While a universal folder loads: DeepSpeed 0.19 warns on every rank that no MPU (model-parallel groups) was
    given, "setting tp size to 1", which is this run's: the trainer has no tensor parallelism."""
    from deepspeed.utils import logger

    def kept(record: logging.LogRecord) -> bool:
        return "MPU is not provided" not in record.getMessage()

    logger.addFilter(kept)
    try:
        yield
    finally:
        logger.removeFilter(kept)


def _identity(tensor) -> object:
    """The same for two names of one tensor (tied weights)."""
    if isinstance(tensor, Lazy):
        return id(tensor) if tensor.identity is None else tensor.identity
    return storage_identity(tensor)


def _shapes(model_states: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for shapes in model_states["param_shapes"] for name, shape in shapes.items()}


def _load(file: Path):
    """A file of DeepSpeed's checkpoint, its tensors on the CPU: a GPU rank would otherwise put a whole module on its
    GPU beside the live engine, and a CPU-only machine could not read a GPU run's files."""
    return torch.load(file, map_location="cpu", weights_only=False)


def _model_states(folder: Path) -> dict:
    """The model-states file, its tensors mapped (ds_to_universal's keeps a ZeRO 1-2 source's whole module there)."""
    return torch.load(folder / MODEL_STATES[0], map_location="cpu", weights_only=False, mmap=True)


def _param(folder: Path, key: str, shape) -> torch.Tensor:
    """One parameter's `key` (fp32, exp_avg, exp_avg_sq) in its shape (from ZeRO-3, ds_to_universal writes it flat)."""
    loaded = _load(folder / f"{key}.pt")
    return (loaded["param"] if isinstance(loaded, dict) else loaded).detach().view(shape)  # ZeRO 1-2's require grad


def _with_plain_names(converted: Path) -> None:
    """A folder ds_to_universal wrote with the engine's names (activation checkpointing's wrapper in them) renamed
    to the plain names."""
    for folder in (converted / "zero").iterdir():
        if folder.is_dir() and plain_name(folder.name) != folder.name:
            folder.rename(folder.with_name(plain_name(folder.name)))
    for file in MODEL_STATES:
        model_states = _load(converted / file)
        model_states["param_shapes"] = [
            {plain_name(name): shape for name, shape in shapes.items()} for shapes in model_states["param_shapes"]
        ]
        shared = model_states.get("shared_params") or {}
        model_states["shared_params"] = {plain_name(k): plain_name(v) for k, v in shared.items()}
        model_states["module"] = {plain_name(k): v for k, v in (model_states.get("module") or {}).items()}
        model_states["buffer_names"] = [plain_name(name) for name in model_states.get("buffer_names") or ()]
        torch.save(model_states, converted / file)


def _readable_by_every_stage(converted: Path) -> None:
    """ds_to_universal writes what the source's stage reads back; ZeRO-3's loader and ZeRO 1-2's look for other
    files and keys (DeepSpeed 0.19). Give both what they need: the model-states file under each name (the engine
    reads the scheduler and step counters there), the optimizer's global state in both layouts, the Adam step
    beside each parameter's moments, and each tensor in the dict ZeRO 1-2 read."""
    import deepspeed

    for name in MODEL_STATES:
        if not (converted / name).exists():
            shutil.copyfile(sorted(converted.glob("*model_states.pt"))[0], converted / name)
    zero = converted / "zero"
    state = _load(zero / "optimizer_state.pt")
    inner = state.get("optimizer_state_dict")
    if inner is not None:  # from ZeRO-3: one step for all parameters
        step, groups = inner["state"][0]["step"], inner["param_groups"]
    else:  # from ZeRO 1-2: a step beside each parameter, all equal
        step, groups = _load(next(zero.glob("*/step.pt"))), state["param_groups"]
    state.setdefault("optimizer_state_dict", {"state": {0: {"step": step}}, "param_groups": groups})
    state.setdefault("param_groups", groups)
    state.setdefault("ds_version", deepspeed.__version__)
    torch.save(state, zero / "optimizer_state.pt")
    for folder in (f for f in zero.iterdir() if f.is_dir()):
        if not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")
        for file in folder.glob("*.pt"):  # ZeRO-3 writes bare tensors, ZeRO 1-2 read {"param": tensor}
            if file.name != "step.pt" and isinstance(tensor := _load(file), torch.Tensor):
                torch.save({"param": tensor}, file)

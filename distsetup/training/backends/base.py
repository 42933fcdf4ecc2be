"""The interface every backend implements (wrap, backward, step, save, load, and the bytes they hold), and what
the backends share: the whole model on each rank's device, a torch optimizer, named-state checkpoints. They subclass
it: one process (single.py), DDP (ddp.py), FSDP2 (fsdp.py) and DeepSpeed (deepspeed.py); the package's make_backend
picks one by name.
"""

import abc
import contextlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, TypeVar

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.formats.batch import global_batch_of
from distsetup.formats.checkpoint_folder import Layout, Marker, described_backend, layout
from distsetup.formats.runconfig import RunConfig
from distsetup.formats.settle import Settled, settle
from distsetup.planning.estimates import BY_KEY
from distsetup.training import memory
from distsetup.training.backends.precision import PRECISION_DTYPES, device_supports, tf32_matmuls
from distsetup.training.checkpoint.files import atomic_save, copied_to_cpu
from distsetup.training.checkpoint.named_state import named_state
from distsetup.training.data.loader import Placement
from distsetup.training.launch_env import World
from distsetup.training.loss.micro_loss import MicroLoss
from distsetup.training.model import from_rank0, moe
from distsetup.training.model.build import Description, ModelParts
from distsetup.training.model.pretrained import Pretrained
from distsetup.training.optim import adamw, lambda_scheduler, names_by_group
from distsetup.training.world import ranks

T = TypeVar("T")
IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # torch optimizers' kernel choices


class Backend(abc.ABC):
    """What the trainer asks of a backend, and what the backends share: the whole model on each rank's device, a
    torch optimizer, named-state checkpoints. single.py, ddp.py, fsdp.py and deepspeed.py subclass it; each says
    what it does with layers that run differently per rank (_handle_conditional)."""

    name: ClassVar[str]
    zero_stage: int | None = None
    # Whether the run joins a process group (one process without one: the single backend)
    needs_process_group = True
    # Whether wrap() fills each rank's shards of the model from rank 0's copy, so that the others never hold it whole
    # (FSDP2). Every backend fills each rank's model from rank 0's values: only rank 0 builds them.
    fills_shards_from_rank0 = False
    # Whether each rank constructs only its partitions of the model (construct()), rank 0's values put in (ZeRO-3).
    partitions_at_construction = False
    # The planner's strategy (planning.estimates.STRATEGIES) whose weights, gradients and optimizer states each rank
    # holds: the trainer counts them as `distsetup plan` does
    memory_strategy = "ddp"
    # Where fills_shards_from_rank0: how a checkpoint that holds every parameter is read instead (model/pretrained.py)
    reads_pretrained = ""

    def __init__(self, cfg: RunConfig, world: World, device: torch.device, settled: Settled | None = None) -> None:
        """`settled`: the values the run config and the backend's file settle to (formats/settle.py); without a
        file, the run config's."""
        self.cfg, self.world, self.device = cfg, world, device
        settled = settled or settle(cfg, None, None, world.size)
        self.micro_batch, self.accumulation = settled.micro_batch, settled.accumulation
        self.precision, self.lr, self.grad_clip = settled.precision, settled.lr, settled.grad_clip
        self.activation_checkpointing, self.lr_scaled = settled.activation_checkpointing, settled.lr_scaled
        source = settled.sources["precision"]  # the setting a user changes to change it (bf16: training.precision)
        self.precision_source = "training.precision" if source.startswith("training.") else source
        self.notes: list[str] = list(settled.notes)  # what rank 0 should tell the user about the backend's choices
        self.memory: dict | None = None
        self.activation_bytes: int | None = None  # saved for backward by the first micro-batch
        self._grad_bytes = 0
        self.converted_from: Layout | None = None  # the layout of a checkpoint to convert on resume (named_state.py)
        self.placement = Placement(device)  # where batches go
        self._writer: ThreadPoolExecutor | None = None  # the thread of background checkpoint writes
        self.tf32 = False  # fp32 matmuls in TF32 (set_up_device)
        self.unrouted_as_zero: list[nn.Module] = []  # layers whose experts none ran get a zero gradient (moe.py)

    @property
    def weights_cast_without_autocast(self) -> str | None:
        """How the model's weights are 16-bit in its forward where no torch.autocast casts each operation's inputs
        (said when a forward mixing dtypes fails), or None: single and DDP train in 16 bits under autocast."""
        return None

    @property
    def gathers_weights(self) -> bool:
        """Whether each step gathers the layers' weights from their shards and frees them again."""
        return BY_KEY[self.memory_strategy].gathers_weights

    # -- the interface -------------------------------------------------------------------------------
    def wrap(self, parts: ModelParts, steps: int) -> None:
        """Place the model, build optimizer and scheduler (self.model, self.optimizer, self.scheduler); the
        learning-rate schedule spans the run's `steps`."""
        self._prepare_blocks(parts.module, parts.blocks)
        self._handle_conditional(parts.conditional)
        self.model = self._place(self._whole_on_device(parts.module), parts)
        self._build_optimizer(self.model, steps)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None

    def _whole_on_device(self, module: nn.Module) -> nn.Module:
        """The whole model on this rank's device. In a world of several, only rank 0 built its values (the others
        built it on the meta device: model_setup.whole_model), and every rank's copy is filled with them."""
        if self.world.size == 1:
            return module.to(self.device)
        return from_rank0.replicate(module, self.device, self.world.is_main)

    def backward(self, loss_of: Callable[[nn.Module], MicroLoss], last_micro: bool) -> MicroLoss:
        """Forward and backward one micro-batch: `loss_of(model)` (objective.py) computes its loss. Returns it
        detached, left on the device (reading it would make the host wait for the device); gradients are
        synchronised on the last micro-batch only."""
        with self._sync(last_micro), self._autocast():
            micro = self._forward(loss_of)
        scaled = self._averaged(micro.loss)
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return micro.detached()

    def _averaged(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss / the accumulation steps: gradients summed over them average the micro-batches."""
        return loss if self.accumulation == 1 else loss / self.accumulation

    def evaluate(self, compute: Callable[[nn.Module], T]) -> T:
        """`compute(model)` of a validation micro-batch: no gradients, dropout off."""
        self.model.eval()
        try:
            with torch.no_grad(), self._autocast():
                return compute(self.model)
        finally:
            self.model.train()

    def step(self) -> None:
        """Clip, update, advance the schedule, drop the gradients. A step the fp16 loss scale skips (an overflow)
        leaves the schedule where it is, as DeepSpeed's engine and Accelerate's scheduler do: the same run config
        follows the same schedule under every backend."""
        moe.zero_gradient_where_none(self.unrouted_as_zero)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        updated = True
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            updated = self.scaler.get_scale() >= scale  # an overflow skips the update and lowers the scale
        else:
            self.optimizer.step()
        if updated:
            self.scheduler.step()
        self._measure_memory()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, path: Path) -> None:
        """Rank 0 writes the full state in one file, atomically (DDP replicas are identical)."""
        if self.world.is_main:
            atomic_save(self._full_state(), path / "state.pt")

    def start_save(self, path: Path) -> list[Future]:
        """training.async_checkpoint: what save() writes, copied now (the loop waits only for that) and written by
        a background thread; the futures complete once this rank's files are on disk."""
        if not self.world.is_main:
            return []
        return [self._in_background(atomic_save, copied_to_cpu(self._full_state()), path / "state.pt")]

    def _full_state(self) -> dict:
        state = {
            "model": self._plain_model().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def _in_background(self, write: Callable[..., object], *args: object) -> Future:
        """`write(*args)` on this process's one checkpoint thread: writes happen in the order they were asked."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        return self._writer.submit(write, *args)

    def adopt(self, path: Path, marker: Marker) -> str | None:
        """Before wrap(): prepare to resume checkpoint `path` (its COMPLETE marker: `marker`), written by any backend
        at any world size; returns a line for the user when that takes a conversion."""
        if self._loads_as_is(marker):
            return None
        self.converted_from = marker.files_layout
        scale = ", fp16 loss scale" if marker.precision == self.precision == "fp16" else ""
        return (
            f"checkpoint {path.name} ({marker.written_by}, "
            f"{ranks(marker.world_size)}) converted for this run ({described_backend(self.name, self.zero_stage)}, "
            f"{ranks(self.world.size)}): weights, AdamW moments and steps, scheduler{scale}"
        )

    def _loads_as_is(self, marker: Marker) -> bool:
        """Whether this backend loads a checkpoint with marker `marker` without converting it."""
        return marker.files_layout == layout(self.name, self.zero_stage)

    def load(self, path: Path) -> None:
        """Restore model, optimizer and scheduler from checkpoint `path`."""
        if self.converted_from is None:
            self._load_own(path)
        else:
            self._load_named(named_state(path, self.converted_from, self._groups()))

    def _load_named(self, state: dict) -> None:
        """A named state (named_state.py) into model, optimizer, scheduler and fp16 loss scaler."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if "lr_lambdas" not in state["scheduler"]:  # a DeepSpeed file's own scheduler wrote it
            raise DistsetupError(
                "the checkpoint's learning-rate schedule is a DeepSpeed file's scheduler block, which this run's "
                "warmup + cosine schedule cannot continue.",
                "resume it with that DeepSpeed file.",
            )
        model = self._plain_model()
        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        # the settings this optimizer has (DeepSpeed's CPU Adam keeps others), the checkpoint's values for them
        groups = [
            {**{k: v for k, v in own.items() if k != "params"}, **{k: v for k, v in saved.items() if k in own}}
            | {"params": saved["params"]}
            for own, saved in zip(self.optimizer.param_groups, state["optimizer"]["param_groups"], strict=True)
        ]
        self._load_named_optimizer(state, self._with_own_kernels(groups))
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])

    def _load_named_optimizer(self, state: dict, param_groups: list[dict]) -> None:
        """A named state's optimizer state, in `param_groups` (by name; this optimizer's settings), into this one."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        optimizer = {"state": state["optimizer"]["state"], "param_groups": param_groups}
        set_optimizer_state_dict(
            self._plain_model(), self.optimizer, optimizer, options=StateDictOptions(full_state_dict=True)
        )

    def _with_own_kernels(self, groups: list[dict]) -> list[dict]:
        """A checkpoint's param groups with this run's kernel choices (fused on a GPU), not the writer's."""
        return [
            {**saved, **{k: own[k] for k in IMPLEMENTATION if k in own}}
            for own, saved in zip(self.optimizer.param_groups, groups, strict=True)
        ]

    def _groups(self) -> list[list[str]]:
        """The parameter names in each of the optimizer's param groups."""
        return names_by_group(self._plain_model(), self.optimizer.param_groups)

    def _load_own(self, path: Path) -> None:
        state = torch.load(path / "state.pt", map_location=self.device, weights_only=False)
        self._plain_model().load_state_dict(state["model"])
        groups = self._with_own_kernels(state["optimizer"]["param_groups"])
        self.optimizer.load_state_dict({**state["optimizer"], "param_groups": groups})
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def checkpoint_complete(self, path: Path) -> None:  # noqa: B027 (most formats need nothing)
        """Rank 0, once checkpoint `path` is complete on every rank: tell its format's own tools so."""

    def checkpoint_withdrawn(self, path: Path) -> None:  # noqa: B027 (most formats need nothing)
        """Rank 0, once checkpoint `path` is withdrawn: tell its format's own tools so."""

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def scheduled_peak_lr(self) -> float | None:
        """The peak lr the schedule runs to (after a resume, the checkpoint's: the scheduler's state holds it), or
        None for a DeepSpeed file's own scheduler."""
        peaks = getattr(self.scheduler, "base_lrs", None)
        return float(peaks[0]) if peaks else None

    def current_loss_scale(self) -> float | None:
        """The fp16 loss scale the next backward multiplies the loss by; None out of fp16."""
        return self.scaler.get_scale() if self.scaler else None

    def check_model(self, description: Description) -> None:
        """Refuse, before any process group, what the backend's settings ask of a model it does not have."""
        return None  # most backends' settings name nothing of the model

    def check_device_support(self) -> None:
        """Refuse, before any process group, a precision this device cannot train in."""
        if not device_supports(self.device, self.precision):
            raise DistsetupError(
                f"{self.precision_source} asks for bf16, which needs an Ampere or newer GPU; this one is older.",
                f"set {self.precision_source} to fp16 (DDP, DeepSpeed) or fp32.",
            )

    def set_up_device(self) -> None:
        """Once the precision is settled and supported: an fp32 run's matmuls in TF32 on a GPU that has it (Ampere or
        newer; nanoGPT's choice, and what Lightning asks fp32 users for), unless NVIDIA_TF32_OVERRIDE=0 keeps full fp32.
        Through set_float32_matmul_precision: torch 2.13 refuses to read its older flags (get_float32_matmul_precision,
        matmul.allow_tf32, which Inductor reads) once matmul.fp32_precision has been set. cuDNN convolutions use TF32
        by torch's own default already."""
        self.tf32 = tf32_matmuls(self.device, self.precision, os.environ)
        if self.tf32:
            torch.set_float32_matmul_precision("high")

    def fit_to_the_model(self, parameters: int) -> None:  # noqa: B027 (DDP fits nothing to the model)
        """Settle what depends on the model's size, `parameters`, before the model is built (in the process group:
        the ranks may have to agree)."""

    def construct(
        self, build: Callable[[], nn.Module], whole: nn.Module, source: Pretrained | None = None
    ) -> nn.Module:
        """Where partitions_at_construction: the model `build()` makes, each rank holding only its partitions, with
        rank 0's `whole` model's values (the others' `whole` is on the meta device), or `source`'s, where the run
        starts from a checkpoint that holds every parameter (`whole`: a skeleton, its buffers built)."""
        raise NotImplementedError(f"{self.name} builds the model whole")

    def needs_cpu_collectives(self) -> bool:
        """Whether the run reduces tensors that live on the CPU over the job's process group, which then needs gloo
        beside NCCL (world.process_group_backend)."""
        return False

    # -- helpers --------------------------------------------------------------------------------------
    def _forward(self, loss_of: Callable[[nn.Module], MicroLoss]) -> MicroLoss:
        """The micro-batch's loss; the first call also counts the bytes its forward saves for backward."""
        if self.activation_bytes is not None:
            return loss_of(self.model)
        with memory.SavedActivations(self.model) as saved:
            micro = loss_of(self.model)
        self.activation_bytes = saved.bytes
        return micro

    def _build_optimizer(self, model: nn.Module, steps: int) -> None:
        t = self.cfg.training
        self.optimizer = adamw(model, self.lr, t.betas, t.weight_decay, self.device)
        self.scheduler = lambda_scheduler(self.optimizer, t, steps)

    def _prepare_blocks(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """training.activation_checkpointing, then training.compile, on each block (before any sharding)."""
        from distsetup.training.model.blocks import apply_activation_checkpointing, compile_blocks

        if (self.checkpointing() != "none" or self.cfg.training.compile) and not blocks:
            wanted = "training.activation_checkpointing" if self.checkpointing() != "none" else "training.compile"
            raise DistsetupError(
                f"{wanted} works block by block, and no block class of the model was found.",
                f"name its repeated block classes in model.layer_classes, or turn {wanted} off.",
            )
        if self.checkpointing() != "none":
            apply_activation_checkpointing(model, blocks, self.checkpointing())
        if self.cfg.training.compile:
            compile_blocks(model, blocks)

    def summary(self) -> dict:
        """Its part of summary.json."""
        cuda = self.device.type == "cuda"
        return {
            "backend": self.name,
            "zero_stage": self.zero_stage,
            "precision": self.precision,
            "memory": self.memory,
            "peak_activation_bytes": self.activation_bytes,
            "peak_device_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
        }

    def line(self) -> str:
        """The run's backend line: the backend and the settled batch, precision, clipping, lr and recomputation."""
        details = f" ({self.details()})" if self.details() else ""
        world = self.world.size
        return (
            f"backend {self.name}{details} on {world} x {self.device.type}; global batch "
            f"{global_batch_of(self.micro_batch, self.accumulation, world)} = micro {self.micro_batch} x accumulation "
            f"{self.accumulation} x world {world}; {self.precision}{' (TF32 matmuls)' if self.tf32 else ''}; "
            f"grad clip {self.grad_clip:g}; peak lr "
            f"{self.lr:.6g}; activation checkpointing {self.checkpointing()}"
        )

    def details(self) -> str:
        """What the backend line says after the backend's name: "ZeRO-2, optimizer offloaded to cpu"."""
        return ""

    def checkpointing(self) -> str:
        """none, full or selective: activation checkpointing as this run asks for it."""
        return self.activation_checkpointing

    @abc.abstractmethod
    def _handle_conditional(self, layers: list[nn.Module]) -> None:
        """What this backend needs for layers that run differently per rank (moe.py)."""

    def hang_hint(self, conditional: bool) -> str | None:
        """What could make this backend's ranks wait for each other for ever (the lost-contact line), for a model
        with layers that run differently per rank (`conditional`) or without."""
        return None

    def _place(self, model: nn.Module, parts: ModelParts) -> nn.Module:
        """The model as this backend trains it, once on its device."""
        return model

    def _plain_model(self) -> nn.Module:
        return self.model

    def _sync(self, last_micro: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=PRECISION_DTYPES[self.precision])

    def _measure_memory(self) -> None:
        """Once, after the first update, when parameters, gradients and optimizer state all exist."""
        if self.memory is None:
            params = list(self.model.parameters())
            self.memory = {
                "params": memory.tensor_bytes(params),
                "grads": memory.grad_bytes(params),
                "optimizer": memory.tensor_bytes(memory.state_tensors(self.optimizer.state)),
            }

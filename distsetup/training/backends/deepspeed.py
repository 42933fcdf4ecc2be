"""DeepSpeed ZeRO 0-3 from a DeepSpeed file; DeepSpeed owns the optimizer step and the checkpoints.

A ZeRO 1-3 run resumes any other checkpoint as DeepSpeed's universal folder (universal_folder.py), loaded with
`checkpoint.load_universal`: one of ZeRO 1-3 at another world size or stage converted by DeepSpeed's own
ds_to_universal, any other written from its named state. ZeRO-0 keeps the whole module and its optimizer in one
file, which any world size of the same precision loads as it is: a torch optimizer in fp32, DeepSpeed's wrapper
around one, with fp32 masters, in bf16 (zero0_wrapper.py). It takes other backends' state by parameter name, as the
torch backends do.
"""

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import Marker, find_resume, layout
from distsetup.formats.deepspeed import SIZED_BY_ROOM, enabled_precisions, offload_device, unset_sizes, zero_stage_of
from distsetup.formats.runconfig import RunConfig
from distsetup.formats.settle import settle
from distsetup.formats.validate import read_valid
from distsetup.planning.estimates import BY_KEY, keeps_deepspeed_sizes, zero_strategy
from distsetup.planning.models import ModelShape
from distsetup.training.backends import rank0_buffers, zero3_blocks, zero3_construction, zero_memory
from distsetup.training.backends.base import IMPLEMENTATION, Backend, T
from distsetup.training.backends.deepspeed_comm import join_deepspeed_comm
from distsetup.training.backends.deferred_compile import compile_deferred
from distsetup.training.backends.precision import PRECISION_DTYPES, device_supports
from distsetup.training.backends.zero3_master_weights import share_master_weights
from distsetup.training.checkpoint import loss_scale, universal_folder, zero0_wrapper
from distsetup.training.checkpoint.files import atomic_write_text
from distsetup.training.checkpoint.named_state import ZERO0_FILE, lazy_state
from distsetup.training.checkpoint.streamed_io import MappedTorchFile
from distsetup.training.data.loader import Placement
from distsetup.training.launch_env import World
from distsetup.training.loss.micro_loss import MicroLoss
from distsetup.training.model import build as models
from distsetup.training.model import from_rank0, moe, pretrained
from distsetup.training.model.blocks import outermost
from distsetup.training.model.build import ModelParts
from distsetup.training.optim import adamw, count_steps_as_it_does, lambda_scheduler, names_by_group, param_groups
from distsetup.training.world import decided_by_rank0, ranks

# What DeepSpeed 0.19's universal load takes from the folder, where the run's own DeepSpeed file should decide: the
# loss scaler whole, settings included (into a bf16 run too), and in ZeRO 1-2 the gradient clipping
FILE_SETTINGS = ("loss_scaler", "dynamic_loss_scale", "clip_grad")


class DeepSpeedBackend(Backend):
    name = "deepspeed"
    zero_stage: int  # from the file (0 where it has no zero_optimization block)
    leaves: tuple[torch.nn.Module, ...] = ()  # ZeRO-3's leaf modules, each gathered whole (_choose_leaves)
    whole_blocks: tuple[torch.nn.Module, ...] = ()  # those of them that are the model's blocks

    def __init__(self, cfg: RunConfig, world: World, device: torch.device) -> None:
        file = cfg.distributed.deepspeed_config
        assert file is not None  # the run config's rules ask for it with this backend
        # refused where `distsetup validate --world_size N` finds a problem, so the batch identity holds
        self.ds_config = read_valid(file, "deepspeed", world.size)
        settled = settle(cfg, self.ds_config, None, world.size, f"DeepSpeed file {file}")
        if settled.problems:
            raise settled.problems[0].as_error()
        super().__init__(cfg, world, device, settled)
        self.own_checkpoint: Path | None = None  # a checkpoint this run loads as DeepSpeed wrote it
        t = cfg.training
        # what the file leaves out, DeepSpeed gets from the run config
        self.ds_config.update(
            train_micro_batch_size_per_gpu=settled.micro_batch,
            gradient_accumulation_steps=settled.accumulation,
            train_batch_size=settled.train_batch,
            gradient_clipping=settled.grad_clip,
        )
        if self.precision != "fp32" and not enabled_precisions(self.ds_config):
            self.ds_config[self.precision] = {"enabled": True}
        self.zero_stage = zero_stage_of(self.ds_config)
        # ZeRO-3 partitions the model as it is constructed, rank 0's values put in: no rank holds it whole but rank 0
        self.fills_shards_from_rank0 = self.partitions_at_construction = self.zero_stage == 3
        self.reads_pretrained = "rank 0 one parameter at a time, into every rank's partitions"
        self.offload = offload_device(self.ds_config, "offload_optimizer") != "none"
        offloaded_param = offload_device(self.ds_config, "offload_param")
        self.memory_strategy = zero_strategy(self.zero_stage, self.offload, offloaded_param != "none")
        if self.precision != "fp32":  # the engine holds its weights in this dtype and casts no input
            self.placement = Placement(device, PRECISION_DTYPES[self.precision])
        if t.async_checkpoint:
            self.notes.append(
                "training.async_checkpoint: DeepSpeed checkpoints are written synchronously (its own background "
                "writer, the decoupled checkpoint engine, needs its async_io op, which distsetup does not drive)"
            )
        block = self.ds_config.get("optimizer")
        if block:  # the file's optimizer wins: DeepSpeed builds it (a CPU Adam when it offloads), with the lr settled
            block.setdefault("params", {})["lr"] = self.lr

    def construct(
        self, build: Callable[[], nn.Module], whole: nn.Module, source: pretrained.Pretrained | None = None
    ) -> nn.Module:
        join_deepspeed_comm(self.world, self.device)
        try:
            return zero3_construction.partitioned(build, whole, source, self.ds_config, self.world.is_main, self.device)
        except zero3_construction.NotPartitioned as e:
            m = self.cfg.model
            builder = {"python": f"model.builder {m.builder}", "hf": f"transformers' model of {m.hf_path}"}
            cannot = (
                f"{builder.get(m.type, 'the built-in GPT')} cannot be built inside deepspeed.zero.Init, which "
                f"partitions each parameter as it is created (a size read from a parameter is 0 there): {e}"
            )
            if source is not None:  # no rank holds the values whole to replicate
                sized = (
                    "size the model from model.args, not from a parameter's shape, or " if m.type == "python" else ""
                )
                raise DistsetupError(
                    f"{cannot}.", f"{sized}train it with ZeRO-2 or FSDP2.", alike_on_every_rank=True
                ) from e
            self.notes.append(
                f"{cannot}; every rank holds it whole instead (in fp32 on its device, with rank 0's values), and "
                "DeepSpeed partitions it as it starts"
            )
            return from_rank0.replicate(whole, self.device, self.world.is_main)  # on the process group's device

    def fit_to_the_model(self, parameters: int) -> None:
        """ZeRO's buffers the file leaves unset: DeepSpeed's own sizes where a rank has room for them beside its
        training state (planning.estimates.keeps_deepspeed_sizes, as `distsetup plan` decides: the file then means
        what it means to DeepSpeed and the HF Trainer, at DeepSpeed's pace), else sized from the model's hidden size
        as the HF integration's "auto" sizes them (DeepSpeed's 5e8-element reduce bucket is 2 GB in fp32 whatever the
        model). ZeRO-3's sub_group_size is always the hidden size's (formats.deepspeed.SIZED_BY_ROOM). Every rank
        takes rank 0's answer: ranks that sized them otherwise would run other collectives. A python model, whose
        hidden size is unknown, keeps DeepSpeed's."""
        hidden = models.hidden_size(self.cfg.model)
        zero = self.ds_config.get("zero_optimization")
        if not hidden or not isinstance(zero, dict) or not (sized := unset_sizes(zero, hidden)):
            return
        hardware = models.rank_hardware(self.world, self.device)
        shape = ModelShape(params=parameters, hidden_size=hidden)
        strategy = BY_KEY[self.memory_strategy]
        if decided_by_rank0(lambda: keeps_deepspeed_sizes(strategy, shape, hardware, self.precision)):
            sized = {key: value for key, value in sized.items() if key not in SIZED_BY_ROOM}
            why = f"room for DeepSpeed's own sizes of the others in {models.gib(hardware.gpu_memory)} GiB a rank"
        else:
            why = f"no room for DeepSpeed's own sizes in {models.gib(hardware.gpu_memory)} GiB a rank"
        if sized:
            zero.update(sized)
            said = ", ".join(f"{key} {value:,}" for key, value in sized.items())
            self.notes.append(f"ZeRO buffers sized for hidden size {hidden} ({why}): {said}")

    def details(self) -> str:
        offloads = [
            f"{block.removeprefix('offload_')} offloaded to {offload_device(self.ds_config, block)}"
            for block in ("offload_optimizer", "offload_param")
            if offload_device(self.ds_config, block) != "none"
        ]
        return ", ".join([f"ZeRO-{self.zero_stage}", *offloads])

    def hang_hint(self, conditional: bool) -> str | None:
        if self.zero_stage == 3 and not conditional:
            return (
                "if the model runs other modules on each rank (an MoE's experts), ZeRO-3's gathers wait for each "
                "other: name the layer holding them in model.zero3_leaf_classes"
            )
        return None

    def check_device_support(self) -> None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        checks = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}

        def supported(precision: str) -> bool:
            # DeepSpeed's CUDA accelerator counts emulated bf16 (a V100, a T4) in: the rule of every backend too
            return checks[precision]() and device_supports(self.device, precision)

        if self.precision in checks and not supported(self.precision):
            other = "bf16" if self.precision == "fp16" and supported("bf16") else "fp32"
            raise DistsetupError(
                f"DeepSpeed file {self.cfg.distributed.deepspeed_config} enables {self.precision}, "
                f"which DeepSpeed does not support on this {accelerator.device_name()} device.",
                f"set {self.precision}.enabled to false (regenerate the file with "
                f"{'--bf16' if other == 'bf16' else 'neither --fp16 nor --bf16'}) to train in "
                f"{other}.",
            )

    def wrap(self, parts: ModelParts, steps: int) -> None:
        import deepspeed

        join_deepspeed_comm(self.world, self.device)
        model = parts.module
        self._prepare_blocks(model, parts.blocks)
        self._choose_leaves(model, parts.blocks, parts.conditional)
        self._handle_conditional(parts.conditional)
        if self.zero_stage < 3:  # ZeRO-3's model was built in its partitions (construct)
            model = self._whole_on_device(model)
        t = self.cfg.training
        groups = param_groups(model, t.weight_decay)
        self.groups = names_by_group(model, groups)  # the optimizer's parameters by name (ZeRO flattens them)
        self.scaler = None  # DeepSpeed scales fp16 losses itself
        optimizer = None
        if "optimizer" not in self.ds_config:
            if self.offload:  # ZeRO-Offload steps on the CPU and needs DeepSpeed's CPU Adam
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                optimizer = DeepSpeedCPUAdam(groups, lr=self.lr, betas=tuple(t.betas), adamw_mode=True)
            else:
                optimizer = adamw(model, self.lr, t.betas, t.weight_decay, self.device)
        schedule = None
        if "scheduler" not in self.ds_config:
            schedule = lambda opt: lambda_scheduler(opt, t, steps)  # noqa: E731
        with compile_deferred():
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                model_parameters=groups if optimizer is None else None,
                lr_scheduler=schedule,
                config=self.ds_config,
            )
        self.model = self.engine
        self.buffers_kept_equal = rank0_buffers.kept_equal(self.engine.module, self.cfg.model.type, self.world.size)
        if self.zero_stage == 3:
            share_master_weights(self.engine.optimizer)
        if self.own_checkpoint is not None and self.zero_stage == 0 and self.precision != "fp32":
            self._read_wrapper_of_the_other_form(self.own_checkpoint)

    def _read_wrapper_of_the_other_form(self, path: Path) -> None:
        """A ZeRO-0 bf16 checkpoint whose optimizer wrapper has the other form (the DeepSpeed file's optimizer block
        added or removed since) loads by parameter name: DeepSpeed's own load would fail on it."""
        saved_flat = zero0_wrapper.FLAT in MappedTorchFile(path / ZERO0_FILE).load()["optimizer"]
        flat = hasattr(self.engine.optimizer, zero0_wrapper.FLAT)
        if saved_flat != flat:
            self.converted_from = "zero0"
            self.notes.append(
                f"checkpoint {path.name} holds {zero0_wrapper.FORMS[saved_flat]}, this run "
                f"{zero0_wrapper.FORMS[flat]}: converted by parameter name"
            )

    def _choose_leaves(self, model: nn.Module, blocks: list[nn.Module], conditional: list[nn.Module]) -> None:
        """ZeRO-3's leaf modules (zero3_blocks.py): each block where this run may, and each layer running other
        experts per rank that no such block holds."""
        if self.zero_stage != 3:
            return
        self.whole_blocks = tuple(zero3_blocks.gathered_whole(self.cfg, self.ds_config, model, blocks))
        self.leaves = zero3_blocks.made_leaves(self.whole_blocks, conditional)
        if self.whole_blocks:
            self.notes.append(
                f"ZeRO-3 gathers each block whole, as FSDP2 does ({moe.described_layers(outermost(blocks))}; "
                "zero_optimization.stage3_module_granularity_threshold in the DeepSpeed file chooses otherwise)"
            )

    def _handle_conditional(self, layers: list[nn.Module]) -> None:
        """ZeRO-3 gathers each module's parameters in its forward: ranks running different experts would wait for
        each other's gathers, so each such layer is gathered whole, a leaf or within its block (_choose_leaves).
        ZeRO 1-2 reduce gradients in the order they become ready, which differs between ranks that ran different
        experts (silently mixing them): every expert takes part with weight 0. ZeRO-0 reduces every parameter's
        gradient, zeros for the unused."""
        if not layers:
            return
        if self.zero_stage == 3:
            how = "ZeRO-3 gathers each whole (a leaf module, or within its block)"
        elif self.zero_stage in (1, 2):
            moe.give_every_expert_a_gradient(layers)
            how = "every expert gets a zero gradient on every rank (ZeRO 1-2 reduce gradients as they become ready)"
        else:
            return
        self.notes.append(f"{moe.described_layers(layers)} may run other experts on each rank: {how}")

    def _plain_model(self) -> nn.Module:
        return self.engine.module

    def _autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine casts as its file says

    @property
    def weights_cast_without_autocast(self) -> str | None:
        if self.precision == "fp32":
            return None
        return f"DeepSpeed's engine holds the weights in {self.precision}"

    def backward(self, loss_of: Callable[[nn.Module], MicroLoss], last_micro: bool) -> MicroLoss:
        try:
            micro = self._forward(loss_of)
        except RuntimeError as e:  # a model changing its leaves' input in place: say which leaf, not a traceback
            if self.leaves and moe.leaf_hook_refused(e):
                way_out = zero3_blocks.LAYER_BY_LAYER_HINT if self.whole_blocks else None
                raise DistsetupError(*moe.leaf_hook_problem(list(self.leaves), way_out)) from e
            raise
        if last_micro and self.buffers_kept_equal is not None:
            self.buffers_kept_equal.step_synchronised()
        self.engine.backward(micro.loss)  # DeepSpeed divides by the accumulation steps itself
        if not last_micro:
            self.engine.step()  # only advances DeepSpeed's micro-step counter
        return micro.detached()

    def evaluate(self, compute: Callable[[nn.Module], T]) -> T:
        # the engine's eval() sets its module's flag only: a training.loss reading model.training gets the engine
        self.engine.training = False
        try:
            result = super().evaluate(compute)
        finally:
            self.engine.training = True
        if self.zero_stage == 3:
            # a forward keeps its last layers gathered for a backward, which evaluation never runs: released here,
            # by the optimizer's call (the engine's also collects Python's garbage and empties the device's cache)
            self.engine.optimizer.empty_partition_cache()
        return result

    def step(self) -> None:
        if self.memory is None:
            self._grad_bytes = zero_memory.held_grad_bytes(self.engine)
        self.engine.step()
        self._measure_memory()

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)

    def start_save(self, path: Path) -> list[Future]:
        self.save(path)  # synchronous: see the note in __init__
        return []

    def checkpoint_complete(self, path: Path) -> None:
        # DeepSpeed's `latest` tag, written only now (not by save_checkpoint, before every rank is done): its
        # load_checkpoint and zero_to_fp32.py find the newest complete checkpoint without -t.
        atomic_write_text(path.parent / "latest", path.name)

    def checkpoint_withdrawn(self, path: Path) -> None:
        point_latest_at_the_newest(path.parent)

    def _loads_as_is(self, marker: Marker) -> bool:
        source, stage, size = marker.files_layout, marker.zero_stage, marker.world_size
        # ZeRO-0's optimizer is a torch optimizer in fp32 and DeepSpeed's wrapper around one in bf16 and fp16
        return (source == "zero0" == layout(self.name, self.zero_stage) and marker.precision == self.precision) or (
            source == "zero" and (stage, size) == (self.zero_stage, self.world.size)
        )

    def adopt(self, path: Path, marker: Marker) -> str | None:
        self.marker = marker
        if self._loads_as_is(marker):
            self.own_checkpoint = path
            return None
        converting = f"checkpoint {path} needs converting ({marker.backend}, {ranks(marker.world_size)})"
        if self.zero_stage and offload_device(self.ds_config, "offload_optimizer") == "nvme":
            raise DistsetupError(
                f"{converting}; a run that offloads its optimizer to NVMe cannot load DeepSpeed's universal format, "
                "which conversions use.",
                "offload to cpu for the resume, or resume with the checkpoint's own backend and world size.",
            )
        if "scheduler" in self.ds_config and marker.backend != "deepspeed":
            raise DistsetupError(
                f"{converting}; the scheduler block of DeepSpeed file {self.cfg.distributed.deepspeed_config} cannot "
                "continue another backend's warmup + cosine schedule.",
                "remove the scheduler block (distsetup's schedule then runs), or resume with the checkpoint's backend.",
            )
        if self.zero_stage:
            self.ds_config["checkpoint"] = {**self.ds_config.get("checkpoint", {}), "load_universal": True}
        if marker.files_layout == "universal" and self.zero_stage:  # `distsetup checkpoint convert` wrote it
            self.converted_from = "universal"
            return None
        return super().adopt(path, marker)

    def load(self, path: Path) -> None:
        if self.converted_from is None:
            self._load_engine(path)
        elif self.zero_stage == 0:  # the plain module and a torch optimizer (in bf16/fp16 wrapped), by name
            super().load(path)
            for counter, value in universal_folder.engine_counters(self.marker).items():
                setattr(self.engine, counter, value)
        elif self.converted_from == "universal":
            self._load_universal(path)
        else:
            source = self.converted_from
            if source == "zero":  # another world size or stage: DeepSpeed's own converter
                write = lambda out: universal_folder.from_deepspeed(path, out)  # noqa: E731
            else:  # single, DDP, FSDP or ZeRO-0: their named state written as a universal folder
                write = lambda out: universal_folder.write(  # noqa: E731
                    lazy_state(path, source, self.groups), out, self.marker
                )
            universal = universal_folder.converted_on_rank0(path, write)
            with universal_folder.removed_after_loading(universal, self.world.is_main):
                self._load_universal(universal)

    def _load_universal(self, folder: Path) -> None:
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in self.optimizer.param_groups]
        optimizer = self.engine.optimizer
        own = {key: getattr(optimizer, key) for key in FILE_SETTINGS if hasattr(optimizer, key)}
        with universal_folder.plain_names_in(self.engine), universal_folder.no_tensor_parallel_warning():
            self._load_engine(folder)
        self._mend_universal_load(groups)
        count_steps_as_it_does(optimizer.optimizer)
        for key, value in own.items():
            setattr(optimizer, key, value)
        if "loss_scaler" in own:  # ZeRO-1's BF16_Optimizer (bf16 with fp32 gradient accumulation) has none
            saved = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
            loss_scale.restore(own["loss_scaler"], saved.get("loss_scaler"))

    def _load_engine(self, folder: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(str(folder.parent), tag=folder.name)
        if loaded is None:
            raise DistsetupError(f"DeepSpeed could not load checkpoint {folder}.", "start with --no_resume.")

    def _mend_universal_load(self, groups: list[dict]) -> None:
        """Undo what DeepSpeed 0.19's ZeRO-3 universal load gets wrong: it gives every parameter group the first
        group's settings in the checkpoint (the parameters without weight decay would take its decay) and one
        `step` tensor to every sub-group, which AdamW then advances once per sub-group, correcting its moments for
        too many steps (optim.count_steps_as_it_does, called next, gives each sub-group its own). Each group gets
        back its own weight decay and this run's kernel choices; the rest (betas, eps) stays the checkpoint's, as
        every other backend's resume keeps it (base._load_named)."""
        if self.zero_stage == 3:
            for group, settings in zip(self.optimizer.param_groups, groups, strict=True):
                group.update({k: v for k, v in settings.items() if k == "weight_decay" or k in IMPLEMENTATION})

    def _load_named_optimizer(self, state: dict, param_groups: list[dict]) -> None:
        if self.zero_stage == 0 and self.precision != "fp32":  # DeepSpeed's wrapper, with fp32 masters
            settings = [{k: v for k, v in group.items() if k != "params"} for group in param_groups]
            zero0_wrapper.load(self.engine.optimizer, state, self.groups, settings)
            count_steps_as_it_does(self.engine.optimizer.optimizer)
        else:
            super()._load_named_optimizer(state, param_groups)

    def _groups(self) -> list[list[str]]:
        return self.groups  # DeepSpeed's optimizer holds flat or fp32 copies of the parameters, not themselves

    def current_lr(self) -> float:
        return self.engine.get_lr()[0]

    def current_loss_scale(self) -> float | None:
        return float(self.engine.optimizer.loss_scale) if self.precision == "fp16" else None

    def _measure_memory(self) -> None:
        if self.memory is None:
            self.memory = zero_memory.held_bytes(self.engine, self.zero_stage, self._grad_bytes)


def point_latest_at_the_newest(root: Path) -> None:
    """DeepSpeed's `latest` tag names the newest complete checkpoint under `root` again, or is gone where there is
    none: its load_checkpoint and zero_to_fp32.py, without -t, would read a withdrawn one."""
    newest = find_resume(root)[0]
    if newest is None:
        (root / "latest").unlink(missing_ok=True)
    else:
        atomic_write_text(root / "latest", newest.name)

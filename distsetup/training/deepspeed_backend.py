"""DeepSpeed ZeRO 0-3 from a DeepSpeed file; DeepSpeed owns the optimizer step and the checkpoints.

A checkpoint written at another world size or ZeRO stage (1-3) is converted by DeepSpeed's own ds_to_universal
into its universal format, which the engine loads with `checkpoint.load_universal`; ZeRO-0 keeps the whole
model and optimizer in one file, which any world size loads as it is.
"""

import argparse
import contextlib
import io
import shutil
import tempfile
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats.deepspeed import batch_of, offload_device, precision_of, zero_stage_of
from distsetup.formats.validate import read_valid
from distsetup.training import memory
from distsetup.training.backend import Backend
from distsetup.training.checkpoint import atomic_write_text
from distsetup.training.optim import adamw, lambda_scheduler, param_groups
from distsetup.training.world import barrier, decided_by_rank0, last_line, ranks

UNIVERSAL_PREFIX = ".universal-"  # the hidden folder of output_dir a conversion writes, removed once loaded


class DeepSpeedBackend(Backend):
    name = "deepspeed"

    def __init__(self, cfg, world, device):
        super().__init__(cfg, world, device)
        # refused where `distsetup validate --world_size N` finds a problem, so the batch identity holds
        self.ds_config = read_valid(cfg.distributed.deepspeed_config, "deepspeed", world.size)
        batch = batch_of(self.ds_config, world.size)
        micro, accumulation, total = batch.micro, batch.accumulation, batch.train_batch
        t = cfg.training
        if (micro, accumulation) != (t.micro_batch_size, t.gradient_accumulation_steps):
            self.notes.append(
                f"micro batch {micro} and accumulation {accumulation} from the DeepSpeed file "
                f"(run config says {t.micro_batch_size} and {t.gradient_accumulation_steps})"
            )
        self.micro_batch, self.accumulation = micro, accumulation
        self.ds_config.update(
            train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation, train_batch_size=total
        )
        self.zero_stage = zero_stage_of(self.ds_config)
        self.universal = None  # the folder (a Path) the checkpoint to resume was converted into, if it was
        self.offload = offload_device(self.ds_config, "offload_optimizer") != "none"
        precision = precision_of(self.ds_config)
        if precision != self.precision:
            self.notes.append(f"precision {precision} from the DeepSpeed file (run config says {self.precision})")
        self.precision = precision
        clip = self.ds_config.get("gradient_clipping", 0.0)
        if clip != t.grad_clip:
            self.notes.append(f"gradient clipping {clip} from the DeepSpeed file (run config says {t.grad_clip})")
        block = self.ds_config.get("optimizer")
        if block:  # the file's optimizer wins: DeepSpeed builds it (a CPU Adam when it offloads)
            self.lr = block.setdefault("params", {}).setdefault("lr", t.lr)
            self.lr_from_file = True
            self.notes.append(f"optimizer {block.get('type')} (lr {self.lr}) from the DeepSpeed file")
            if t.scale_lr != "none":  # `distsetup deepspeed --scale_lr` may have scaled it already
                self.notes.append(
                    f"training.scale_lr {t.scale_lr} not applied: the DeepSpeed file's lr is used as "
                    "written (scale it there with `distsetup deepspeed --scale_lr`)"
                )

    def check_device_support(self):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        supported = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}
        if self.precision in supported and not supported[self.precision]():
            other = "bf16" if self.precision == "fp16" and accelerator.is_bf16_supported() else "fp32"
            raise DistsetupError(
                f"DeepSpeed file {self.cfg.distributed.deepspeed_config} enables {self.precision}, "
                f"which DeepSpeed does not support on this {accelerator.device_name()} device.",
                f"set {self.precision}.enabled to false (regenerate the file with "
                f"{'--bf16' if other == 'bf16' else 'neither --fp16 nor --bf16'}) to train in "
                f"{other}.",
            )

    def wrap(self, model, blocks):
        import deepspeed

        self._checkpoint_activations(model, blocks)
        t = self.cfg.training
        groups = param_groups(model, t.weight_decay)
        optimizer = None
        if "optimizer" not in self.ds_config:
            if self.offload:  # ZeRO-Offload steps on the CPU and needs DeepSpeed's CPU Adam
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                optimizer = DeepSpeedCPUAdam(groups, lr=self.lr, betas=tuple(t.betas), adamw_mode=True)
            else:
                optimizer = adamw(model, self.lr, t.betas, t.weight_decay)
        schedule = None
        if "scheduler" in self.ds_config:
            self.notes.append(f"LR scheduler {self.ds_config['scheduler'].get('type')} from the DeepSpeed file")
        else:
            schedule = lambda opt: lambda_scheduler(opt, t)  # noqa: E731
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=groups if optimizer is None else None,
            lr_scheduler=schedule,
            config=self.ds_config,
        )
        self.model = self.engine

    def backward(self, x, y, last_micro):
        loss = self._forward(x, y)
        self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
        if not last_micro:
            self.engine.step()  # only advances DeepSpeed's micro-step counter
        return loss.detach()

    def step(self):
        if self.memory is None:
            self._grad_bytes = self._held_grads()
        self.engine.step()
        self._measure_memory()

    def save(self, path):
        self.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)

    def checkpoint_complete(self, path):
        # DeepSpeed's `latest` tag, written only now (not by save_checkpoint, before every rank is done): its
        # load_checkpoint and zero_to_fp32.py find the newest complete checkpoint without -t.
        atomic_write_text(path.parent / "latest", path.name)

    def adopt(self, path, meta):
        stage, size = meta.get("zero_stage"), meta["world_size"]
        if (stage, size) == (self.zero_stage, self.world.size) or stage == self.zero_stage == 0:
            return None
        if not stage or not self.zero_stage:
            raise DistsetupError(
                f"checkpoint {path} is ZeRO-{stage} on {size} ranks; this run is ZeRO-{self.zero_stage}: "
                "DeepSpeed's universal format, which changes stages, covers ZeRO 1-3 only.",
                f"resume with zero_optimization.stage {stage}.",
            )
        if offload_device(self.ds_config, "offload_optimizer") == "nvme":
            raise DistsetupError(
                f"checkpoint {path} is ZeRO-{stage} on {size} ranks; a run that offloads its optimizer to NVMe "
                "cannot load DeepSpeed's universal format, which changes world sizes and stages.",
                f"resume on {size} ranks with ZeRO-{stage}, or offload to cpu for the resume.",
            )
        self.ds_config["checkpoint"] = {**self.ds_config.get("checkpoint", {}), "load_universal": True}
        converted = decided_by_rank0(lambda: _to_universal(path))
        if isinstance(converted, str):  # rank 0's error, raised on every rank
            raise DistsetupError(converted, f"move {path} aside to resume from the one before, or --no_resume.")
        self.universal = converted
        return (
            f"checkpoint {path.name} (ZeRO-{stage}, {ranks(size)}) converted by DeepSpeed's ds_to_universal "
            f"for this run (ZeRO-{self.zero_stage}, {ranks(self.world.size)})"
        )

    def load(self, path):
        folder = self.universal / path.name if self.universal else path
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in self.optimizer.param_groups]
        try:
            loaded, _ = self.engine.load_checkpoint(str(folder.parent), tag=folder.name)
            if self.universal:
                barrier()  # every rank has read it
        finally:
            if self.universal and self.world.is_main:
                shutil.rmtree(self.universal, ignore_errors=True)
        if loaded is None:
            raise DistsetupError(f"DeepSpeed could not load checkpoint {path}.", "start with --no_resume.")
        if self.universal and self.zero_stage == 3:
            self._mend_zero3_universal_load(groups)

    def _mend_zero3_universal_load(self, groups: list[dict]) -> None:
        """Undo two slips of ZeRO-3's universal load (DeepSpeed 0.19): it gives every parameter group the first
        group's settings (the parameters without weight decay would take it), and one `step` tensor to every
        sub-group, which AdamW then advances once per sub-group and so corrects its moments for too many steps."""
        for group, settings in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(settings)
        inner = self.engine.optimizer.optimizer
        for state in inner.state.values():
            if hasattr(state.get("step"), "clone"):  # a tensor (DeepSpeed's CPU Adam counts in an int)
                state["step"] = state["step"].clone()

    def current_lr(self):
        return self.engine.get_lr()[0]

    # -- the bytes each ZeRO stage really holds ---------------------------------------------------
    def _held_grads(self) -> int:
        """Gradients at the accumulation boundary: full .grad (stages 0-1) or this rank's partitions."""
        opt = self.engine.optimizer
        tensors = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
            tensors += memory.state_tensors(getattr(opt, name, None))
        # ZeRO-Offload accumulates this rank's gradients on its CPU master partition.
        tensors += [
            t.grad
            for t in memory.state_tensors(getattr(opt, "single_partition_of_fp32_groups", None))
            if t.grad is not None
        ]
        tensors += memory.state_tensors(
            getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
        )
        return memory.tensor_bytes(tensors)

    def _measure_memory(self):
        if self.memory is not None:
            return
        opt, params = self.engine.optimizer, list(self.engine.module.parameters())
        if self.zero_stage == 3:
            held = [p.ds_tensor for p in params] + [p.data for p in params if getattr(p, "ds_persist", False)]
        else:
            held = params
        inner = getattr(opt, "optimizer", opt)
        # fp32 master copies of this rank's partition (ZeRO keeps them even when training in fp32).
        master = (
            (
                memory.state_tensors(getattr(opt, "single_partition_of_fp32_groups", None))
                + memory.state_tensors(getattr(opt, "fp32_partitioned_groups_flat", None))
            )
            if self.zero_stage
            else []
        )
        self.memory = {
            "params": memory.tensor_bytes(held),
            "grads": self._grad_bytes,
            "optimizer": memory.tensor_bytes(memory.state_tensors(inner.state)),
            "master_params": memory.tensor_bytes(master),
        }


def _to_universal(path: Path) -> Path | str:
    """Checkpoint folder `path` converted by DeepSpeed's ds_to_universal into a new folder beside the checkpoints
    (the source untouched) that every ZeRO stage 1-3 loads; returns the folder holding the converted `path.name`,
    or the error as one line."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    output_dir = path.parent.parent
    for stale in output_dir.glob(f"{UNIVERSAL_PREFIX}*"):  # left by a run killed while converting or loading
        shutil.rmtree(stale, ignore_errors=True)
    root = None
    try:
        root = Path(tempfile.mkdtemp(dir=output_dir, prefix=UNIVERSAL_PREFIX))
        converted = root / path.name
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
        _readable_by_every_stage(converted)
    except Exception as e:  # a damaged checkpoint, a full or read-only disk: one line on every rank
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        return f"cannot convert checkpoint {path} to DeepSpeed's universal format: {last_line(e)}."
    return root


def _readable_by_every_stage(converted: Path) -> None:
    """ds_to_universal writes what the source's stage reads back; ZeRO-3's loader and ZeRO 1-2's look for other
    files and keys (DeepSpeed 0.19). Give both what they need: the model-states file under each name (the engine
    reads the scheduler and step counters there), the optimizer's global state in both layouts, the Adam step
    beside each parameter's moments, and each tensor in the dict ZeRO 1-2 read."""
    import deepspeed
    import torch

    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"):
        if not (converted / name).exists():
            shutil.copyfile(sorted(converted.glob("*model_states.pt"))[0], converted / name)
    zero = converted / "zero"
    state = torch.load(zero / "optimizer_state.pt", weights_only=False)
    inner = state.get("optimizer_state_dict")
    if inner is not None:  # from ZeRO-3: one step for all parameters
        step, groups = inner["state"][0]["step"], inner["param_groups"]
    else:  # from ZeRO 1-2: a step beside each parameter, all equal
        step, groups = torch.load(next(zero.glob("*/step.pt")), weights_only=False), state["param_groups"]
    state.setdefault("optimizer_state_dict", {"state": {0: {"step": step}}, "param_groups": groups})
    state.setdefault("param_groups", groups)
    state.setdefault("ds_version", deepspeed.__version__)
    torch.save(state, zero / "optimizer_state.pt")
    for folder in (f for f in zero.iterdir() if f.is_dir()):
        if not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")
        for file in folder.glob("*.pt"):  # ZeRO-3 writes bare tensors, ZeRO 1-2 read {"param": tensor}
            if file.name != "step.pt" and isinstance(tensor := torch.load(file, weights_only=False), torch.Tensor):
                torch.save({"param": tensor}, file)

"""FSDP2 (`fully_shard`) driven by the FSDP file that `distsetup fsdp` writes (Accelerate's key names)."""

import contextlib
import copy
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from distsetup.errors import DistsetupError
from distsetup.formats.fsdp import TRAINER_FP16_PROBLEM, TRAINER_PRECISIONS, FsdpSpec
from distsetup.formats.problems import closest
from distsetup.formats.runconfig import RunConfig
from distsetup.formats.settle import settle
from distsetup.formats.validate import read_fsdp_settings
from distsetup.planning.estimates import BY_KEY, device_state, has_room, model_states
from distsetup.planning.models import ModelShape
from distsetup.training.backends import fsdp_on_cpu, rank0_buffers
from distsetup.training.backends.base import Backend
from distsetup.training.backends.fsdp_precision import FsdpPrecision
from distsetup.training.backends.fsdp_root_output import output_not_a_view
from distsetup.training.checkpoint.files import atomic_save
from distsetup.training.launch_env import World
from distsetup.training.loss.micro_loss import MicroLoss
from distsetup.training.model import build as models
from distsetup.training.model import from_rank0, moe, pretrained
from distsetup.training.model.blocks import in_place_of, layer_modules
from distsetup.training.model.build import ModelParts

# The planner's strategy holding what each sharding strategy holds (HYBRID_SHARD_ZERO2: at most what HYBRID_SHARD does)
PLANNED = {
    "FULL_SHARD": "fsdp_full_shard",
    "SHARD_GRAD_OP": "fsdp_shard_grad_op",
    "HYBRID_SHARD": "fsdp_hybrid_shard",
    "HYBRID_SHARD_ZERO2": "fsdp_hybrid_shard",
}


def check_wrapped_classes(cfg: RunConfig, fsdp: FsdpSpec, description: models.Description) -> None:
    """Each class the FSDP settings wrap is one of the model's: `distsetup fsdp` writes the built-in GPT's Block
    unless told the model's. Refused before the process group, and in --check."""
    present, blocks = description.module_classes, description.layer_classes
    if not (missing := sorted(set(fsdp.wrapped_classes) - present)):
        return
    d = cfg.distributed
    settings = "distributed.fsdp" if d.fsdp else f"FSDP file {d.fsdp_config}"
    near = [close for name in missing if (close := closest(name, present)) is not None]  # typos: LlamaDecoderLayr
    raise DistsetupError(
        f"{settings}: fsdp_transformer_layer_cls_to_wrap: no module of class {', '.join(missing)} in the model "
        f"(its blocks: {', '.join(blocks) or 'none found'}).",
        (f"did you mean {', '.join(near)}? " if near else "")
        + "name the model's blocks there (`distsetup fsdp --transformer_layer_cls_to_wrap "
        + f"{','.join(blocks) or 'YourBlock'}` writes such a file), or leave the key out: the model's blocks are then "
        "the units.",
    )


class FSDPBackend(Backend):
    name = "fsdp"
    fills_shards_from_rank0 = True
    reads_pretrained = "each rank the rows of its own shards"

    def __init__(self, cfg: RunConfig, world: World, device: torch.device) -> None:
        self.fsdp = read_fsdp_settings(cfg)
        super().__init__(cfg, world, device, settle(cfg, None, self.fsdp, world.size))
        self.strategy = self.fsdp.sharding_strategy
        self.memory_strategy = PLANNED.get(self.strategy, "ddp")  # NO_SHARD: each rank holds it whole
        if self.precision not in TRAINER_PRECISIONS:
            raise DistsetupError(*TRAINER_FP16_PROBLEM)
        self.mixed_precision = FsdpPrecision(self.precision, self.fsdp.reduce_dtype, bool(cfg.training.loss))
        self.full_state_dict = self.fsdp.state_dict_type == "FULL_STATE_DICT"
        self.mesh_shape = mesh_shape(self.strategy, world.size, world.local_size)
        self.hands_back_freed_heap = False  # on the CPU, where a rank has no room (fit_to_the_model)
        if len(self.mesh_shape) == 2:
            self.notes.append(
                f"{self.strategy}: 2-D device mesh, replicate {self.mesh_shape[0]} x shard {self.mesh_shape[1]}"
            )

    def details(self) -> str:
        return self.strategy

    def fit_to_the_model(self, parameters: int) -> None:
        """On the CPU, whether this rank has room to keep the pages its heap frees (planning.estimates.has_room, the
        rule for DeepSpeed's buffer sizes too): its training state as `distsetup plan` counts it (shards, gradients,
        AdamW's moments, the layers it gathers) against its share of the node's (or its container's) memory. Without
        room, backward's freed activations go back to the system before its gradients take new pages
        (fsdp_on_cpu.hold_one_layer_at_a_time): at 8 processes the others' peak over 2 steps fell from 0.82 to 0.72
        of a 200M model, and a CPU step took 10-12% longer, as the next forward faults those pages in again
        (docs/benchmarks.md)."""
        if self.device.type != "cpu" or self.memory_strategy == "ddp":
            return
        hardware = models.rank_hardware(self.world, self.device)
        rank_memory = hardware.gpu_memory
        m = self.cfg.model
        shape = ModelShape(params=parameters, hidden_size=models.hidden_size(m), num_layers=models.num_layers(m))
        states = model_states(BY_KEY[self.memory_strategy], shape, hardware, self.precision)
        state = device_state(states) + (states["gathered"] if shape.hidden_size else 0)  # layers of unknown size: none
        self.hands_back_freed_heap = not has_room(state, rank_memory)
        if self.hands_back_freed_heap:
            self.notes.append(
                "the heap's free pages handed back after each layer's gradients are reduced (a lower peak, slower "
                f"steps): no room for them beside {models.gib(state)} GiB of training state in "
                f"{models.gib(rank_memory)} GiB a rank"
            )

    def wrap(self, parts: ModelParts, steps: int) -> None:
        """Shard the model before anything is allocated whole: each rank's model goes to the meta device (rank 0 keeps
        its values on the CPU; the others built none), is sharded there, gets only its own shards on its device and
        takes rank 0's values into them (from_rank0.py), or, where the run starts from a checkpoint holding every
        parameter, reads its shards' rows from it (pretrained.py)."""
        model, blocks, source = parts.module, parts.blocks, parts.pretrained
        whole = from_rank0.whole_values(model, self.world.is_main) if source is None else None
        # where a checkpoint gives the values: each rank's skeleton's buffers, as built (rank 0's are broadcast)
        built_buffers = dict(model.named_buffers(remove_duplicate=False)) if source is not None else {}
        from_rank0.to_meta(model)
        units = self._units(model, blocks, parts.conditional)
        self._prepare_blocks(model, blocks)  # the blocks, whatever the wrapping policy
        units = in_place_of(model, units)  # their activation-checkpointing wrappers, where there are some
        kwargs: dict[str, Any] = {
            "mesh": self._mesh(),
            "mp_policy": self.mixed_precision.units(),
            "offload_policy": self._offload(),
        }
        # none inside a layer that runs differently per rank (an expert): one rank would gather it and another not
        left_out = {id(m) for layer in parts.conditional for m in layer.modules()} | {id(unit) for unit in units}
        norms = self.mixed_precision.norms_in_fp32(model, left_out)
        in_fp32 = {**kwargs, "mp_policy": self.mixed_precision.norms()}
        for norm in norms:  # inside the units: sharded first
            fully_shard(norm, reshard_after_forward=self.fsdp.reshards_after_forward, **in_fp32)
            norm.register_forward_hook(output_not_a_view, prepend=True, with_kwargs=True)  # see below
        last = last_in_module_order(model, units)
        kept = {id(module) for module in last.modules()} if last is not None else set()  # and the units inside it
        for unit in innermost_first(model, units):  # a unit inside another (nested block classes) is sharded first
            # the last unit's backward comes first, right after its forward: resharding it in between would only
            # gather it again (torchtitan's policy)
            fully_shard(unit, reshard_after_forward=self.fsdp.reshards_after_forward and id(unit) not in kept, **kwargs)
            unit.register_forward_hook(output_not_a_view, prepend=True, with_kwargs=True)  # see below
        # the root last: it holds what no unit took (embeddings, head), which backward gathers at its start whatever
        # forward did; kept gathered, as FSDP2 keeps a root left to its own choice (reshard_after_forward None)
        fully_shard(model, reshard_after_forward=False, **{**kwargs, "mp_policy": self.mixed_precision.root()})
        if self.device.type == "cpu":
            fsdp_on_cpu.hold_one_layer_at_a_time([*norms, *units, model], self.hands_back_freed_heap)
        # FSDP2 keeps offloaded shards on the CPU: the state dict then goes there too (one device for all), and the
        # buffers, which FSDP2 never offloads, onto this rank's device after it
        offloaded = self.fsdp.cpu_offload and self.device.type == "cuda"
        model.to_empty(device=torch.device("cpu") if offloaded else self.device)
        if source is None:
            from_rank0.fill_from_rank0(model, whole, self.device)
        else:
            pretrained.fill_shards(model, source, built_buffers, self.device, self.world.is_main)
        del whole, built_buffers
        # before FSDP2's own hook: it warns of a view among a unit's outputs (see output_not_a_view)
        model.register_forward_hook(output_not_a_view, prepend=True, with_kwargs=True)
        self.buffers_kept_equal = rank0_buffers.kept_equal(
            model, self.cfg.model.type, self.world.size
        )  # as DDP keeps them
        self.model = model
        self._handle_conditional(parts.conditional)
        if self.cfg.training.async_checkpoint and not self.full_state_dict:  # every rank creates them, here
            # one gloo group per async_save: each writes on a thread of its own, and two threads' collectives on
            # one group could pair up differently on each rank
            self._async_groups = {part: torch.distributed.new_group(backend="gloo") for part in ("model", "optim")}
        self.scaler = None
        self._build_optimizer(model, steps)

    def check_model(self, description: models.Description) -> None:
        """The classes the FSDP settings wrap, each one of the model's (one that is not stopped every rank after the
        process group): `distsetup fsdp` writes the built-in GPT's Block unless told the model's. And the precision's
        own check (fsdp_precision.py)."""
        self.mixed_precision.check(description, self.cfg.training.activation_checkpointing)
        check_wrapped_classes(self.cfg, self.fsdp, description)

    def _units(self, model: nn.Module, blocks: list[nn.Module], conditional: list[nn.Module]) -> list[nn.Module]:
        """The modules sharded each as one unit (before the root), as the FSDP file's wrapping policy says; never one
        inside a layer that runs differently per rank (an expert), which one rank would gather and another not."""
        policy = self.fsdp.auto_wrap_policy
        if policy == "NO_WRAP":
            return []
        if policy == "SIZE_BASED_WRAP":
            units = _size_based_units(model, self.fsdp.min_num_params or 100_000_000)
        elif names := self.fsdp.wrapped_classes:
            units = layer_modules(model, list(names), "the FSDP file's fsdp_transformer_layer_cls_to_wrap")
            own = sorted({type(block).__name__ for block in blocks})
            takes_blocks = self.activation_checkpointing != "none" or self.cfg.training.compile
            if blocks and takes_blocks and own != sorted(set(names)):
                settings = "distributed.fsdp" if self.cfg.distributed.fsdp else "the FSDP file"
                self.notes.append(
                    f"FSDP units: {settings}'s fsdp_transformer_layer_cls_to_wrap ({', '.join(sorted(names))}), not "
                    f"the model's blocks ({', '.join(own)}), which activation checkpointing and compile take"
                )
        else:
            units = blocks
        kept = [unit for unit in units if not moe.inside(unit, conditional)]
        if len(kept) < len(units):
            self.notes.append(
                f"{len(units) - len(kept)} FSDP units inside {moe.described_layers(conditional)} left to the unit "
                "around them (each its own unit, a rank would gather the experts it runs, another rank others)"
            )
        return kept

    def _handle_conditional(self, layers: list[nn.Module]) -> None:
        """FSDP2 reduce-scatters the gradients each rank has: a rank that ran other experts would hand in others.
        Where torch has it, FSDP2 gives the unused ones zeros itself; else every expert takes part with weight 0."""
        if not layers:
            return
        if hasattr(self.model, "set_reduce_scatter_unused_params"):
            self._sharded.set_reduce_scatter_unused_params(True)
            how = "FSDP2 reduce-scatters zeros for the experts a rank did not run"
        else:
            moe.give_every_expert_a_gradient(layers)
            how = "every expert gets a zero gradient on every rank"
        self.notes.append(f"{moe.described_layers(layers)} may run other experts on each rank: {how}")

    def _mesh(self) -> DeviceMesh:
        if len(self.mesh_shape) == 2:
            return init_device_mesh(self.device.type, self.mesh_shape, mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.device.type, self.mesh_shape, mesh_dim_names=("shard",))

    def _autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the mixed-precision policy casts

    @property
    def weights_cast_without_autocast(self) -> str | None:
        if self.precision == "fp32":
            return None
        return f"FSDP2's mixed-precision policy casts the weights to {self.precision}"

    def needs_cpu_collectives(self) -> bool:
        """Offloaded to the CPU, the gradients that clipping reduces live there (as CPU DTensors)."""
        return self.fsdp.cpu_offload and self.device.type == "cuda"

    def _offload(self) -> OffloadPolicy:
        if not self.fsdp.cpu_offload:
            return OffloadPolicy()
        if self.device.type != "cuda":
            self.notes.append("fsdp_offload_params ignored: parameters already live on the CPU")
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=True)

    @property
    def _sharded(self) -> FSDPModule:
        """The model as fully_shard made it: an FSDPModule, whose methods set how gradients are synchronised."""
        return cast(FSDPModule, self.model)

    def backward(self, loss_of: Callable[[nn.Module], MicroLoss], last_micro: bool) -> MicroLoss:
        self._sharded.set_requires_gradient_sync(last_micro)
        micro = self._forward(loss_of)
        if last_micro and self.buffers_kept_equal is not None:
            self.buffers_kept_equal.step_synchronised()
        self._averaged(micro.loss).backward()
        return micro.detached()

    def save(self, path: Path) -> None:
        if self.full_state_dict:
            state = self._gathered_full_state()
            if self.world.is_main:
                atomic_save(state, path / "full_state.pt")
            return
        dcp.save(get_model_state_dict(self.model), checkpoint_id=path / "model")
        dcp.save(get_optimizer_state_dict(self.model, self.optimizer), checkpoint_id=path / "optim")
        if self.world.is_main:
            atomic_save({"scheduler": self.scheduler.state_dict()}, path / "scheduler.pt")

    def start_save(self, path: Path) -> list[Future]:
        """DCP's async_save: it copies this rank's shards to the CPU, then writes them on a thread, coordinating
        the ranks over gloo groups of its own (the training loop's collectives keep the default group). The
        full state, gathered now, is written by rank 0's checkpoint thread."""
        if self.full_state_dict:
            state = self._gathered_full_state()  # fresh CPU tensors: nothing to copy again
            return [self._in_background(atomic_save, state, path / "full_state.pt")] if self.world.is_main else []
        parts: dict[str, dict[str, Any]] = {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
        }
        writes = [  # a Future (an AsyncSaveResponse only where given an async stager)
            cast(Future, dcp.async_save(state, checkpoint_id=path / part, process_group=self._async_groups[part]))
            for part, state in parts.items()
        ]
        if self.world.is_main:
            atomic_save({"scheduler": self.scheduler.state_dict()}, path / "scheduler.pt")
        return writes

    def _gathered_full_state(self) -> dict:
        """The whole model and optimizer state, gathered to rank 0's CPU (a collective: every rank calls it)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=options),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),  # a background write outlives this step
        }

    def _load_own(self, path: Path) -> None:
        if (path / "full_state.pt").exists():
            state = torch.load(path / "full_state.pt", map_location="cpu", weights_only=False)
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, state["model"], options=options)
            optimizer = {
                **state["optimizer"],
                "param_groups": self._with_own_kernels(state["optimizer"]["param_groups"]),
            }
            set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=options)
        else:
            model = get_model_state_dict(self.model)
            dcp.load(model, checkpoint_id=path / "model")
            set_model_state_dict(self.model, model)
            optim = get_optimizer_state_dict(self.model, self.optimizer)
            load_keeping_own_settings(optim, path / "optim")
            optim["param_groups"] = self._with_own_kernels(cast(list, optim["param_groups"]))
            set_optimizer_state_dict(self.model, self.optimizer, optim)
            state = torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(state["scheduler"])


def load_keeping_own_settings(optim: dict, folder: Path) -> None:
    """DCP folder `folder`'s optimizer state loaded into `optim` (get_optimizer_state_dict's), the settings of its
    param groups that the folder does not hold kept as this run's own (dcp.load refuses a key the checkpoint lacks): a
    folder converted from DeepSpeed's Adam has no amsgrad, foreach, fused, ..., one of an older torch lacks a newer
    setting (the named-state load keeps this run's the same way: Backend._load_named)."""
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    groups = cast(list, optim["param_groups"])
    own = [
        {key: group.pop(key) for key in list(group) if key != "params" and f"param_groups.{i}.{key}" not in saved}
        for i, group in enumerate(groups)
    ]
    dcp.load(optim, checkpoint_id=folder)
    for group, settings in zip(cast(list, optim["param_groups"]), own, strict=True):
        group.update(settings)


def mesh_shape(strategy: str, world_size: int, local_size: int) -> tuple[int, ...]:
    """1-D over all ranks; HYBRID_* and NO_SHARD: 2-D (replicate, shard), sharded within a node
    (LOCAL_WORLD_SIZE processes) and replicated across nodes; NO_SHARD shards over 1."""
    if strategy != "NO_SHARD" and not strategy.startswith("HYBRID"):
        return (world_size,)
    shard = 1 if strategy == "NO_SHARD" else local_size
    if world_size % shard:
        raise DistsetupError(
            f"{strategy} needs the world size ({world_size}) to be a multiple of the processes per node ({shard}).",
            "launch the same number on every node.",
        )
    return (world_size // shard, shard)


def innermost_first(model: torch.nn.Module, units: list) -> list:
    """`units` with each one inside another before it: FSDP2 shards bottom up, and an outer unit sharded first takes
    the inner one's parameters, which fully_shard then refuses ("Cannot concatenate overlapping meshes")."""
    depth = {id(module): name.count(".") + bool(name) for name, module in model.named_modules()}
    return sorted(units, key=lambda unit: depth[id(unit)], reverse=True)  # stable: units side by side keep their order


def last_in_module_order(model: torch.nn.Module, units: list) -> torch.nn.Module | None:
    """The unit that comes last among the model's modules: a transformer's last block, the last to run forward (of
    nested units the outer one: the inner one within it runs before it ends)."""
    order = {id(module): position for position, module in enumerate(model.modules())}
    inside = {id(inner) for unit in units for inner in list(unit.modules())[1:]}
    return max((unit for unit in units if id(unit) not in inside), key=lambda unit: order[id(unit)], default=None)


def _size_based_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Submodules (children first) that gather at least min_num_params not yet taken by a smaller unit. A module that
    holds a parameter also held outside it (a head tied to the embedding) is no unit: FSDP2 refuses a parameter in
    two units, and the tie stays with the unit around both, the root's at last."""
    ties = [{id(holder) for holder, _ in places} for places in from_rank0.tied_parameters(model)]
    units: list[torch.nn.Module] = []
    taken: set[int] = set()  # id() of the parameters already in a unit
    for module in reversed(list(model.modules())[1:]):
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue  # containers have no forward of their own, so their parameters would never be gathered
        inside = {id(m) for m in module.modules()} if ties else set()
        if any(holders & inside and not holders <= inside for holders in ties):
            continue
        own = [p for p in module.parameters() if id(p) not in taken]
        if sum(p.numel() for p in own) >= min_num_params:
            units.append(module)
            taken.update(id(p) for p in own)
    return units

"""The model a run config's model section describes: the built-in GPT (gpt.py), a Hugging Face causal LM from a
local folder, or the user's own module (model.type python: model.builder called with model.args). Each is trained
as the module it is, so its parameters keep their own names in checkpoints and exports.

`describe` builds it on the meta device first (no memory, no weights, nothing downloaded): before any process group
the builder is checked, the block classes found and the parameters counted."""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from distsetup.errors import DistsetupError, first_line
from distsetup.formats.runconfig import BUILTIN_BLOCK
from distsetup.planning.estimates import BY_KEY, Hardware, device_state, model_states
from distsetup.planning.models import ModelShape, gpt_params
from distsetup.training import memory, user_code
from distsetup.training.launch_env import World
from distsetup.training.model import moe
from distsetup.training.model.blocks import layer_modules
from distsetup.training.model.gpt import GPT
from distsetup.training.model.running_statistics import keeps_running_statistics

if TYPE_CHECKING:
    from distsetup.training.model.pretrained import Pretrained


@dataclass(frozen=True)
class Description:
    """What the model section's model is, learnt from a copy built on the meta device."""

    layer_classes: list[str]  # its repeated blocks' classes (model.layer_classes, or found)
    parameters: int
    conditional: str  # its layers that run differently per rank (moe.py), described; "" for none
    notes: list[str] = field(default_factory=list)  # what rank 0 says about it
    builds_on_meta: bool = True  # whether its builder builds it on the meta device (one that reads a weight cannot)
    module_classes: frozenset[str] = frozenset()  # its modules' classes but its own
    running_statistics_classes: frozenset[str] = frozenset()  # those of its modules that keep some (BatchNorm's)


@dataclass
class ModelParts:
    """A built model and what the backends need to know of it."""

    module: nn.Module
    blocks: list[nn.Module]  # the modules of the layer classes: FSDP2's units, what is checkpointed and compiled
    conditional: list[nn.Module]  # the layers that run differently per rank (moe.py)
    # where the values come from, read a slice at a time (pretrained.py); None: the module's own (rank 0's)
    pretrained: "Pretrained | None" = None


def build(m, weights: bool = True) -> nn.Module:
    """The model of model section `m`, on the current default device, in fp32 (the run's seed gives a one-process
    run's weights). `weights`: a Hugging Face folder's own, where it has some (else fresh ones from its config)."""
    if m.type == "gpt":
        return GPT(m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.dropout)
    if m.type == "hf":
        return _hf_model(m, with_weights=weights)
    try:
        model = _call_builder(m)
    except DistsetupError as e:
        e.alike_on_every_rank = True  # the same code and arguments on every rank
        raise
    except Exception as e:
        raise DistsetupError(
            f"model.builder {m.builder} raised {user_code.what_raised(e)}.",
            f"fix {m.builder} or model.args.",
            alike_on_every_rank=True,
        ) from None
    return model.float()


def build_to_be_filled(m) -> nn.Module:
    """build(m, weights=False) for a model whose every parameter is written afterwards (ZeRO-3's partitions, filled
    from rank 0 or a checkpoint): where transformers is loaded (model.type hf, or a builder that uses it), its models
    and torch's layers skip their initialisation, as transformers' own ZeRO-3 path does. Inside deepspeed.zero.Init
    an embedding's padding row, zeroed by transformers' init, read an empty partition (Gemma's, OPT's, any config
    with a pad_token_id), and the model was never partitioned."""
    if "transformers" not in sys.modules:
        return build(m, weights=False)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers before 5
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
    with no_init_weights():
        return build(m, weights=False)


def _call_builder(m) -> nn.Module:
    """model.builder(**model.args), which must return an nn.Module; what the builder itself raises goes through."""
    builder = user_code.load(m.builder, "model.builder")
    user_code.check_takes(builder, "model.builder", **m.args)
    model = builder(**m.args)
    if not isinstance(model, nn.Module):
        raise DistsetupError(
            f"model.builder {m.builder} returned a {type(model).__name__}, not a torch.nn.Module.",
            "return the model (an nn.Module) from it.",
        )
    return model


def architecture_on_meta(m) -> nn.Module:
    """The model of model section `m` built on the meta device: its parameters' names and shapes, no memory. A
    builder's own exception goes through (some builders cannot build there: they read a weight's value)."""
    with torch.device("meta"):
        if m.type == "hf":
            return _hf_model(m, with_weights=False)
        if m.type == "python":
            return _call_builder(m).float()  # as build() makes it: every rank's copy in the dtypes of rank 0's
        return build(m)


# What a builder raises for arguments it does not take, though its signature (**kwargs) did not say
SIGNATURE_ERRORS = ("unexpected keyword argument", "required positional argument", "required keyword-only argument")


def check_on_meta(m) -> "Description | None":
    """For `--check`, before any process starts: a python or Hugging Face model section's model built on the meta
    device and described as every rank describes it, for what only building it tells: model.args its builder's own
    calls refuse (under **kwargs), model.layer_classes, model.zero3_leaf_classes and DeepSpeed's MoE layer; the
    description for what the backend's settings ask of it. None where its builder fails there otherwise (it reads a
    weight, or what the launcher sets): left to the ranks."""
    try:
        model = architecture_on_meta(m)
    except DistsetupError:
        raise
    except TypeError as e:
        if not any(words in str(e) for words in SIGNATURE_ERRORS):
            return None
        raise DistsetupError(
            f"model.builder {m.builder} raised {user_code.what_raised(e)}.", f"fix {m.builder} or model.args."
        ) from None
    except Exception:
        return None
    return _described(model, m, [])


def architecture(m) -> tuple[nn.Module, list[str]]:
    """The model section `m`'s model to inspect: built on the meta device, or on the CPU where its builder cannot
    build there (said in the note returned)."""
    try:
        return architecture_on_meta(m), []
    except DistsetupError:
        raise
    except Exception as e:
        note = (
            f"model: model.builder cannot build on the meta device ({first_line(e)}): checked on the CPU, and in a "
            "run of several processes every rank builds it whole"
        )
        return build(m), [note]


def describe(m) -> Description:
    """The model section `m`'s model, checked on a copy built on the meta device (on the CPU where its builder
    cannot build there): the builder and its args, the block classes (model.layer_classes, or the model's own),
    model.zero3_leaf_classes."""
    if m.type == "gpt" and not m.layer_classes:  # its size is arithmetic: 2000 layers need no building to count
        parameters = gpt_params(m.vocab_size, m.block_size, m.n_layer, m.n_embd)
        return Description([BUILTIN_BLOCK], parameters, "", [], module_classes=_gpt_module_classes())
    model, notes = architecture(m)
    return _described(model, m, notes)


def _described(model: nn.Module, m, notes: list[str]) -> Description:
    """describe()'s Description of the model section `m`'s `model`, built (`notes`: how)."""
    moe.refuse_deepspeed_moe(model)
    on_meta = all(p.is_meta for p in model.parameters())
    classes, found = layer_classes(model, m)
    layers = moe.conditional_layers(model, set(classes), m.zero3_leaf_classes)  # each zero3_leaf_classes found
    unique = {id(p): p.numel() for p in model.parameters()}
    present = frozenset(type(module).__name__ for module in model.modules() if module is not model)
    statistics = frozenset(type(module).__name__ for module in model.modules() if keeps_running_statistics(module))
    described = moe.described_layers(layers)
    return Description(classes, sum(unique.values()), described, notes + found, on_meta, present, statistics)


def _gpt_module_classes() -> frozenset[str]:
    """The built-in GPT's modules' classes but its own: a one-layer copy's, on the meta device."""
    with torch.device("meta"):
        one_layer = GPT(vocab_size=2, block_size=2, n_layer=1, n_head=1, n_embd=2, dropout=0.0)
    return frozenset(type(module).__name__ for module in one_layer.modules() if module is not one_layer)


def parts(model: nn.Module, m, classes: list[str]) -> ModelParts:
    """The built `model` with its blocks (of `classes`) and its conditional layers, found."""
    blocks = layer_modules(model, classes) if classes else []
    return ModelParts(model, blocks, moe.conditional_layers(model, set(classes), m.zero3_leaf_classes))


def layer_classes(model: nn.Module, m) -> tuple[list[str], list[str]]:
    """(the classes of the model's repeated blocks, notes): model.layer_classes, each found in the model; else the
    model's own (the built-in GPT's Block, a Hugging Face model's _no_split_modules, or the class of the children of
    a python model's largest nn.ModuleList or nn.Sequential of one class of its own). [] where a python model has
    none."""
    if m.layer_classes:
        layer_modules(model, m.layer_classes)  # each must name a class of the model
        return list(m.layer_classes), []
    if m.type == "gpt":
        return [BUILTIN_BLOCK], []
    present = {type(module).__name__ for module in model.modules()}
    if m.type == "hf":
        own = [name for name in getattr(model, "_no_split_modules", None) or [] if name in present]
        if not own:
            raise DistsetupError(f"{type(model).__name__} names no layer class.", "set model.layer_classes.")
        return own, []
    found = _largest_repeated(model)
    if found is None:
        note = (
            f"model: {type(model).__name__} has no nn.ModuleList or nn.Sequential of one block class, so nothing is "
            "sharded per block, checkpointed or compiled (name its blocks in model.layer_classes for that)"
        )
        return [], [note]
    name, container = found
    note = f"model: blocks of class {name} (the children of {container}, its largest list of one class)"
    return [name], [note]


def _largest_repeated(model: nn.Module) -> tuple[str, str] | None:
    """(the class of the children, the container's name) of the model's nn.ModuleList or nn.Sequential of two or
    more children of one class of the user's (not torch.nn's: blocks are found by class name, and every Conv2d or
    Sequential of the model would be one) that holds the most parameters."""
    best, most = None, -1
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        classes = {type(child) for child in module}
        size = sum(p.numel() for p in module.parameters())
        if len(classes) == 1 and not moe.torch_class(next(iter(classes))) and size > most:
            best, most = (next(iter(classes)).__name__, name or type(model).__name__), size
    return best


def require_transformers() -> None:
    """Hugging Face models need transformers (and huggingface_hub, which it brings): the `hf` extra."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise DistsetupError("model type hf needs transformers.", "pip install 'distsetup[hf]'.") from None


def _hf_model(m, with_weights: bool) -> nn.Module:
    """A transformers causal LM from folder model.hf_path: its weights where it has some (and `with_weights`), else
    fresh ones from its config.json; nothing is downloaded."""
    require_transformers()
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

    path = Path(m.hf_path)
    if not (path / "config.json").exists():
        raise DistsetupError(
            f"model.hf_path {path} has no config.json.",
            "save one with e.g. LlamaConfig(...).save_pretrained(path); nothing is downloaded.",
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:  # an encoder-decoder such as T5 or SwitchTransformers
        raise DistsetupError(
            f"model.hf_path {path} holds a {type(config).__name__}, which transformers builds no causal LM of "
            "(AutoModelForCausalLM), the only kind model.type hf trains.",
            "train it as model.type python: a builder that returns the model, and its own .loss (docs/own-code.md).",
        )
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    fp32 = {_dtype_keyword(): torch.float32}
    if with_weights and has_weights:
        hf = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True, **fp32)
    else:
        hf = AutoModelForCausalLM.from_config(config, **fp32)
    if hf.config.vocab_size < m.vocab_size:
        raise DistsetupError(
            f"the hf model's vocab_size {hf.config.vocab_size} is below model.vocab_size {m.vocab_size}.",
            "raise it in config.json or lower model.vocab_size.",
        )
    return hf


def _dtype_keyword() -> str:
    """transformers' name for the dtype to build in: `dtype` from 4.56 on (`torch_dtype`, before, is deprecated)."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def embedding_rows(m) -> tuple[int, str]:
    """The rows of the embedding of the model section `m`'s model (the ids it can read) and where that is set."""
    if m.type != "hf":
        return m.vocab_size, "model.vocab_size"
    require_transformers()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(m.hf_path, local_files_only=True).vocab_size, f"{m.hf_path}'s vocab_size"
    except (OSError, ValueError) as e:
        raise DistsetupError(f"model.hf_path {m.hf_path}: {e}.", "point it at a folder with a config.json.") from None


def end_of_sequence_ids(m) -> tuple[set[int], str] | None:
    """The ids at which generate() stops for the model section `m`'s Hugging Face model, and the file that names
    them: its folder's generation_config.json, which from_pretrained reads first, else its config.json (or that
    config's text_config, a composite model's). None for another model, or a folder that names none."""
    if m.type != "hf":
        return None
    for name in ("generation_config.json", "config.json"):
        settings = _hf_folder_json(m, name)
        value = settings.get("eos_token_id", (settings.get("text_config") or {}).get("eos_token_id"))
        values = value if isinstance(value, list) else [value]
        ids = {i for i in values if isinstance(i, int) and not isinstance(i, bool)}
        if ids:
            return ids, str(Path(m.hf_path) / name)
    return None


def hidden_size(m) -> int | None:
    """The hidden size of the model section `m`'s model, where it has one that is known without building it: the
    built-in GPT's n_embd, a Hugging Face folder's config.json hidden_size (the key `distsetup plan` reads); None for
    a python model."""
    return m.n_embd if m.type == "gpt" else _hf_config_size(m, "hidden_size")


def num_layers(m) -> int | None:
    """The number of blocks of the model section `m`'s model, where it is known without building it: the built-in
    GPT's n_layer, a Hugging Face folder's config.json num_hidden_layers; None for a python model."""
    return m.n_layer if m.type == "gpt" else _hf_config_size(m, "num_hidden_layers")


def _hf_config_size(m, key: str) -> int | None:
    """A positive size `key` of a Hugging Face model section's config.json; None for another model, or where the file
    does not say."""
    if m.type != "hf":
        return None
    value = _hf_folder_json(m, "config.json").get(key)
    return value if isinstance(value, int) and value > 0 else None


def _hf_folder_json(m, name: str) -> dict:
    """The JSON object in file `name` of a Hugging Face model section's folder; {} where it is absent, unreadable or
    not an object (embedding_rows says what is wrong with a broken config.json)."""
    try:
        settings = json.loads((Path(m.hf_path) / name).read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def training_state_bytes(strategy: str, parameters: int, world: World, precision: str) -> float:
    """Bytes of weights, gradients and optimizer states that one rank holds under the planner's strategy `strategy`
    (planning.estimates.STRATEGIES), counted as `distsetup plan` counts them, offloaded ones included."""
    states = model_states(BY_KEY[strategy], ModelShape(parameters), world_hardware(world), precision)
    return device_state(states) + states["cpu"] / world.local_size  # "cpu": offloaded, per node


def world_hardware(world: World, **settings) -> Hardware:
    """The planner's hardware of this run's world (its nodes, and its processes a node as GPUs), with `settings`."""
    return Hardware(num_nodes=max(1, world.size // world.local_size), gpus_per_node=world.local_size, **settings)


def rank_hardware(world: World, device: torch.device) -> Hardware:
    """This run's world as the planner's hardware, each rank with the memory it trains in (its device's, or on a CPU
    its share of the node's or its container's): what a backend weighs a rank's state against before the model is
    built."""
    rank_memory = memory.device_memory_per_rank(device, world.local_size)
    return world_hardware(world, gpu_memory=rank_memory, runtime_bytes=0)


def check_model_fits(parameters: int, builders: int, setting: str, holders: int = 0, state_bytes: float = 0.0) -> None:
    """Refuse, before any process group, a model this node's memory cannot hold, rather than a traceback from the
    allocator or a visit from the OOM killer: `builders` of its processes build the whole model in CPU memory first
    (4 bytes a parameter): rank 0 alone (the others build it on the meta device), or every one where the builder
    cannot build there; and `holders` of them (those training on the CPU) hold `state_bytes` each of training
    state. `setting`: what the user changes to make the model smaller."""
    whole, available = 4 * parameters * builders, memory.available_memory()
    needed = whole + holders * state_bytes
    if needed <= available:
        return
    parts = [f"{builders} process(es) building it whole ({gib(whole)} GiB)"] if builders else []
    if holders:
        parts.append(f"{holders} training it on the CPU ({gib(state_bytes)} GiB of state each)")
    raise DistsetupError(
        f"the model has {parameters:,} parameters: {' and '.join(parts)} need {gib(needed)} GiB, more than the "
        f"{gib(available)} GiB of memory free here (the machine's, within its container's limit).",
        f"lower {setting}" + (", or shard it over more processes (FSDP2, ZeRO-3)" if holders else "") + ".",
    )


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def size_settings(m) -> str:
    """The settings that make the model section `m`'s model smaller."""
    return {
        "gpt": "model.n_embd, model.n_layer or model.vocab_size",
        "hf": f"the sizes in {m.hf_path}/config.json",
    }.get(m.type, "model.args")

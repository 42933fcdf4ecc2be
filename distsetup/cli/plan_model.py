"""The model a plan is for: from --params and the shape flags (a published shape of about that size standing in for
what is not given), or from a run config (the built-in GPT counted, a Hugging Face or python model on the meta
device), with what that run config implies for the plan (its precision, batch and sequence)."""

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import BUILTIN_BLOCK
from distsetup.planning.models import ModelShape, assumed_shape, gpt_shape, hf_shape_from_json
from distsetup.planning.recommendation import run_config_optimizer
from distsetup.planning.units import in_words, parse_count


def model_from_options(o: dict) -> tuple[ModelShape, dict, list[str]]:
    """The model shape from --params (+ shape flags) or the run config, defaults the config implies, and notes
    on what was assumed."""
    if bool(o["params"]) == bool(o["config"]):
        raise DistsetupError(
            "give exactly one of --params and --config.",
            "e.g. --params 7B --hidden_size 4096 --num_layers 32, or --config config.yaml.",
        )
    return _from_params(o) if o["params"] else _from_run_config(o)


def _from_params(o: dict) -> tuple[ModelShape, dict, list[str]]:
    """--params, and the shape flags (a published shape of about that size for what they leave out)."""
    params = parse_count(o["params"])
    given = (o["hidden_size"], o["num_layers"], o["num_heads"], o["vocab_size"])
    if o["hidden_size"] and o["num_heads"] and o["hidden_size"] % o["num_heads"]:
        h, a = o["hidden_size"], o["num_heads"]
        raise DistsetupError(
            f"--hidden_size {h} is not divisible by --num_heads {a}: every head gets "
            "hidden_size / num_heads dimensions.",
            f"use a multiple of {a} (e.g. {a * max(1, round(h / a))}), or other --num_heads.",
        )
    hidden, layers, heads, vocab = (g or a for g, a in zip(given, assumed_shape(params), strict=True))
    if o["hidden_size"] and o["num_layers"]:
        check_shape_against_params(params, hidden, layers, vocab)
    notes = (
        [
            f"activations assume hidden {hidden}, {layers} layers, {heads} heads, vocab {vocab} (a published "
            "model of about this size); give --hidden_size/--num_layers/--num_heads/--vocab_size for yours."
        ]
        if None in given[:2]
        else []
    )
    return (
        ModelShape(
            params=params,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            vocab_size=vocab,
            layer_cls=o["layer_cls"] or BUILTIN_BLOCK,
        ),
        {},
        notes,
    )


def _from_run_config(o: dict) -> tuple[ModelShape, dict, list[str]]:
    """--config's model, counted, with what the run config implies for the plan; the shape flags shape a python
    model's activations (the planner cannot count them), and are refused beside another."""
    from distsetup.formats.runconfig_load import load_run_config

    # every strategy is planned: the run's own backend and its file are not read, and may come later (from --write)
    backend_choice = ("distributed", "distributed.deepspeed_config", "distributed.fsdp_config")
    cfg = load_run_config(o["config"], not_needed=backend_choice).resolved(Path(o["config"]).parent)
    notes: list[str] = []
    shape_flags = [f"--{name}" for name in ("hidden_size", "num_layers", "num_heads", "vocab_size") if o[name]]
    if cfg.model.type != "python" and shape_flags:
        raise DistsetupError(
            f"{shape_flags[0]} with --config: model.type {cfg.model.type}'s shape is the run config's.",
            f"leave {', '.join(shape_flags)} out (they shape a python model's activations, or go with --params).",
        )
    if cfg.model.type == "python":
        from distsetup.training.user_code import make_importable

        make_importable(Path(o["config"]).parent)  # model.builder's module, next to the run config
    shape = shape_from_run_config(cfg)
    if cfg.model.type == "python" and o["hidden_size"] and o["num_layers"]:  # its activations, in the flags' shape
        shape = _shaped_by_the_flags(shape, o, cfg, notes)
    elif cfg.model.type == "python":
        notes.append(
            "activations are not counted for model.type python (its shapes are its builder's: give --hidden_size and "
            "--num_layers for a transformer's); a run's summary.json has them measured (peak_activation_bytes)."
        )
    defaults = {
        "precision": cfg.training.precision,
        "micro_batch": cfg.training.micro_batch_size,
        "accumulation": cfg.training.gradient_accumulation_steps,
        "chunked_loss": cfg.training.chunked_loss,
        "optimizer": run_config_optimizer(cfg.training),  # a DeepSpeed file written carries the run config's
    }
    if cfg.model.type != "python" or cfg.data.type != "python":  # the GPT's, an HF model's or token data's length
        defaults["seq_len"] = cfg.model.block_size
    return shape, defaults, notes


def _shaped_by_the_flags(shape: ModelShape, o: dict, cfg, notes: list[str]) -> ModelShape:
    """A python model's shape with its activations' from --hidden_size and --num_layers (a transformer's), said in
    `notes`."""
    heads = o["num_heads"] or max(1, o["hidden_size"] // 128)  # activation_bytes' own default
    # the logits: --vocab_size's, or token data's ids; none for the user's own data (an image classifier's)
    vocab = o["vocab_size"] or (cfg.model.vocab_size if cfg.data.type != "python" else None)
    notes.append(
        f"activations of a transformer of hidden {o['hidden_size']}, {o['num_layers']} layers (the flags'), "
        f"{heads} heads{'' if o['num_heads'] else ' (one per 128)'}, "
        + (f"logits over {vocab} ids" if vocab else "no logits (data.type python; --vocab_size gives some)")
        + ", for model.type python"
    )
    return replace(shape, hidden_size=o["hidden_size"], num_layers=o["num_layers"], num_heads=heads, vocab_size=vocab)


# How far --params may be from what the shape flags give (12 x layers x hidden² + vocab x hidden): an MoE model has
# several times its dense shape's parameters (Mixtral 8x7B: 7x), a typo a thousand times
SHAPE_AGREEMENT = 64


def check_shape_against_params(params: int, hidden: int, layers: int, vocab: int) -> None:
    dense = 12 * layers * hidden**2 + vocab * hidden
    if not dense / SHAPE_AGREEMENT <= params <= dense * SHAPE_AGREEMENT:
        raise DistsetupError(
            f"--params {in_words(params)} and --hidden_size {hidden} --num_layers {layers} disagree: a transformer of "
            f"that shape has about {in_words(dense)} parameters (12 x layers x hidden² + vocab x hidden).",
            "give the model's own sizes, or leave them out (the published shape nearest --params is assumed).",
        )


def shape_from_run_config(cfg) -> ModelShape:
    """The built-in GPT counted from its numbers (exact, and without torch: plan answers in a blink); a Hugging Face
    or python model exactly on the meta device when torch is importable, else an HF one from its config.json."""
    m = cfg.model
    if m.type == "gpt":
        layer_cls = (m.layer_classes or [BUILTIN_BLOCK])[0]
        return gpt_shape(m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, layer_cls)
    if importlib.util.find_spec("torch") is not None:
        return count_on_meta(cfg)
    if m.type == "python":
        raise DistsetupError(
            "distsetup plan counts model.type python models on the meta device, which needs torch.",
            "pip install torch, or give --params.",
        )
    return hf_shape_from_json(Path(m.hf_path) / "config.json", (m.layer_classes or [None])[0])


def count_on_meta(cfg) -> ModelShape:
    """Build the model on the meta device (no memory, no weights read; on the CPU where a builder cannot build there)
    and count its parameters."""
    from distsetup.training.model.build import architecture, layer_classes

    m = cfg.model
    model, _ = architecture(m)
    classes = layer_classes(model, m)[0] or ["?"]
    config: Any = getattr(model, "config", None)  # a Hugging Face model's
    if m.type == "hf":
        hidden, n_layer = config.hidden_size, config.num_hidden_layers
        heads, vocab = config.num_attention_heads, config.vocab_size
    elif m.type == "gpt":
        hidden, n_layer, heads, vocab = m.n_embd, m.n_layer, m.n_head, m.vocab_size
    else:  # the user's own: its sizes are its builder's
        hidden = n_layer = heads = vocab = None
    unique = {id(p): p.numel() for p in model.parameters()}
    blocks = [mod for mod in model.modules() if type(mod).__name__ in classes]
    # the largest block: what FSDP and ZeRO-3 gather at once (a mixture of experts' dense layers are smaller)
    sizes = [sum({id(p): p.numel() for p in b.parameters()}.values()) for b in blocks]
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules())
    return ModelShape(
        params=sum(unique.values()),
        hidden_size=hidden,
        num_layers=n_layer if m.type != "python" else len(blocks) or None,
        num_heads=heads,
        vocab_size=vocab,
        block_params=max(sizes, default=None),
        blocks_params=sum(sizes) if sizes else None,
        largest_module_params=largest,
        layer_cls=classes[0],
    )

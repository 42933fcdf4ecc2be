"""How a model is called in training (forward_kwargs) and what its outputs hold (field_of): an object's attribute or a
dict's key, as transformers' ModelOutput has both."""

import inspect
import sys

import torch
import torch.nn as nn


def forward_kwargs(model: nn.Module, model_type: str) -> dict:
    """What a Hugging Face model (model.type hf, or a transformers model a builder returns) is called with in training:
    no KV cache (training never reads one: building it costs memory), and an MoE's router logits, from which it
    computes its load-balancing loss (without them it computes none); each where its forward takes it (a user's
    PreTrainedModel, an image classifier, may take neither)."""
    if model_type != "hf" and not is_transformers_model(model):
        return {}
    kwargs: dict = {"use_cache": False}
    if hasattr(getattr(model, "config", None), "router_aux_loss_coef"):
        kwargs["output_router_logits"] = True
    parameters = inspect.signature(model.forward).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return kwargs
    return {name: value for name, value in kwargs.items() if name in {parameter.name for parameter in parameters}}


def is_transformers_model(model: nn.Module) -> bool:
    """Whether `model` is a transformers PreTrainedModel (a builder that returns one imported transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def terms_left_out(outputs) -> list[str]:
    """The names of the numbers with a gradient that a dict output holds beside its logits, loss and aux_loss (a KL
    term, a z-loss): the next-token loss adds only aux_loss, so a model returning one most likely meant it trained."""
    if not isinstance(outputs, dict):
        return []
    read = ("logits", "loss", "aux_loss")
    return [
        name
        for name, value in outputs.items()
        if name not in read and isinstance(value, torch.Tensor) and value.numel() == 1 and value.requires_grad
    ]


def field_of(outputs, name: str, default):
    """outputs.name, or outputs[name] of a dict, or `default`."""
    if isinstance(outputs, dict):
        return outputs.get(name, default)
    return getattr(outputs, name, default)

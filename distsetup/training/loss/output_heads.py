"""The model's output head, and whether it computes the loss in slices (sliced.py): where training.chunked_loss asks
for it for the vocabulary, and the head is a plain nn.Linear whose output the model returns as its logits."""

from typing import Any

import torch
import torch.nn as nn

from distsetup.planning import loss_slices
from distsetup.training.loss.model_outputs import field_of, forward_kwargs
from distsetup.training.loss.sliced import LossHead, as_loss_head
from distsetup.training.world import decided_by_rank0


def output_head(model: nn.Module, m) -> Any:
    """The built-in GPT's or a Hugging Face model's output head; None for a python model."""
    owner: Any = model  # get_output_embeddings is a transformers PreTrainedModel's
    return owner.lm_head if m.type == "gpt" else owner.get_output_embeddings() if m.type == "hf" else None


def loss_head(model: nn.Module, m, mode: str, probe: nn.Module | None = None) -> tuple[LossHead | None, str]:
    """The built-in GPT's or a Hugging Face model's output head, made to compute the loss in slices where
    training.chunked_loss `mode` asks for it for its vocabulary (see sliced.py), and the note that says what was
    done; (None, "") for a python model or a small vocabulary. `probe`: a copy of the model to run the Hugging Face
    head check on (the model itself where it has no whole weights to run: ZeRO-3's partitions)."""
    head = output_head(model, m)
    vocab: int = getattr(head, "out_features", 0)
    if head is None or not loss_slices.chunked(mode, vocab):
        return None, ""
    probe = probe if probe is not None else model
    # rank 0's answer everywhere: the others' copy may be on the meta device, where a forward can fail (an MoE's
    # data-dependent routing), and every rank must compute the loss alike
    why = decided_by_rank0(lambda: _unsliceable(probe, m, output_head(probe, m)))
    if why:
        return None, f"loss: from the whole logits over {vocab} ids ({why})"
    slices = -(-vocab // loss_slices.slice_width(vocab))
    count = f"{slices} slices" if slices > 1 else "one slice"
    return as_loss_head(head), f"loss: cross-entropy over the {vocab} ids in {count}, never their whole logits"


def _unsliceable(model: nn.Module, m, head: nn.Module) -> str:
    """Why the loss of `model` cannot be computed inside its head, or "": the head is no plain nn.Linear, or (a
    Hugging Face model, asked with a forward of two tokens) the model changes the head's logits before returning
    them (soft-capping or scaling)."""
    if type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not an nn.Linear"
    if m.type != "hf":
        return ""
    ids = torch.zeros((1, 2), dtype=torch.long, device=head.weight.device)
    if _returns_head_output(model, head, ids):
        return ""
    return f"{type(model).__name__} changes its logits after the output head"


def _returns_head_output(model: nn.Module, head: nn.Module, input_ids: torch.Tensor) -> bool:
    """Whether the Hugging Face `model`(input_ids) returns as its logits exactly the object `head` returned."""
    returned = []
    handle = head.register_forward_hook(lambda module, args, output: returned.append(output))
    try:
        with torch.no_grad():
            outputs = model(input_ids, **forward_kwargs(model, "hf"))
    finally:
        handle.remove()
    return len(returned) == 1 and field_of(outputs, "logits", outputs) is returned[0]

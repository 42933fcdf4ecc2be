"""Which labels a Hugging Face model's own loss is the mean over (the HF Trainer's num_items_in_batch counts them):
data.type python weighs each micro-batch by them, so that a step's loss is the mean over the step's labels however
its batch was split (objective.PythonObjective)."""

from collections.abc import Callable

import torch
import torch.nn as nn

# Hugging Face models' own losses that are the mean over the labels that are not -100 (transformers' LOSS_MAPPING,
# by the model's loss_type), and whether they shift them first: a causal LM's targets are the next tokens.
MEAN_OVER_LABELS = {"ForCausalLM": True, "ForMaskedLM": False, "ForTokenClassification": False}


def labels_averaged(module: nn.Module) -> Callable[[dict], torch.Tensor] | None:
    """Where the model's own loss is the mean over a batch's counted labels (a Hugging Face causal LM, masked LM or
    token classifier), the labels of a batch it counts, as the HF Trainer counts them for num_items_in_batch; else
    None."""
    shifted = MEAN_OVER_LABELS.get(getattr(module, "loss_type", None) or "")
    if shifted is None or getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        return None
    return _next_token_labels if shifted else _labels


def _next_token_labels(batch: dict) -> torch.Tensor:
    return batch["labels"][..., 1:]


def _labels(batch: dict) -> torch.Tensor:
    return batch["labels"]

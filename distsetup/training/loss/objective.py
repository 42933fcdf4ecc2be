"""What a micro-batch's loss is: the one interface between the trainer and every model and data kind.

- Token data (synthetic, files, chat, ...): the batch is (input ids, target ids), the model's forward(input_ids)
  returns the logits [B, T, vocab] (or an object or dict holding `logits`, and an `aux_loss` to add), and the loss is
  the mean cross-entropy over the counted targets. For a large vocabulary the built-in GPT's and a Hugging Face
  model's output head computes it a slice of the vocabulary at a time instead (sliced.py, training.chunked_loss):
  the logits never exist whole. A Hugging Face model is called as transformers trains it (no KV
  cache) and an MoE one with its router logits: its load-balancing loss is added as transformers adds it,
  `router_aux_loss_coef` x `aux_loss` (also where a builder returns it, as model.type python); another python
  model's `aux_loss` is added as it is (weighted inside the model).
- The user's own data (data.type python): training.loss(model, batch), or else model(**batch) (a dict) or
  model(*batch) (a list or tuple), whose result is the loss or holds it as `.loss` (the Hugging Face convention).

The first call checks what the user's code returned, in one line naming the setting to fix.
"""

from collections.abc import Callable

import torch.nn as nn

from distsetup.formats.runconfig import RunConfig
from distsetup.training.data.datasets import Datasets
from distsetup.training.loss.counted_labels import labels_averaged
from distsetup.training.loss.model_outputs import forward_kwargs
from distsetup.training.loss.output_heads import loss_head
from distsetup.training.loss.python_objective import PythonObjective
from distsetup.training.loss.token_objective import TokenObjective


def objective_for(
    module: nn.Module, cfg: RunConfig, data: Datasets, loss_function: Callable | None, probe: nn.Module | None = None
) -> tuple["TokenObjective | PythonObjective", str]:
    """The objective a run trains `module` by, and a note on how its loss is computed (or ""): token data's
    next-token loss from the model's logits (sliced where training.chunked_loss says), else the model's own loss or
    training.loss on the user's batches. `probe`: see loss_head."""
    m, t = cfg.model, cfg.training
    source = f"model.builder {m.builder}" if m.type == "python" else f"model.type {m.type}"
    if data.tokens and loss_function is None:  # token data: its train set says whether targets are masked
        head, note = loss_head(module, m, t.chunked_loss, probe)
        return TokenObjective(module, m.type, m.vocab_size, data.train.masked, source, head), note
    loss_source = t.loss and f"training.loss {t.loss}"
    counted = labels_averaged(module) if loss_function is None else None
    return PythonObjective(loss_function, loss_source, source, forward_kwargs(module, m.type), counted), ""

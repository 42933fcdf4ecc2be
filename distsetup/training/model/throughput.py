"""Model FLOPs utilization: items/s x training FLOPs per item / the devices' peak. For the built-in GPT and Hugging
Face causal LMs, FLOPs per token = 6N + 12 L d T (N parameters outside the embedding tables, which are looked up
rather than multiplied; L layers, width d, sequence T: the PaLM paper's appendix B, as nanoGPT counts); for the
user's own model, what PyTorch's FLOP counter counts in the forward and backward of one micro-batch, on the meta
device (no memory, no time)."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from distsetup.errors import first_line
from distsetup.formats.runconfig import ModelConfig
from distsetup.training.model.gpt import GPT

# Dense bf16 (and fp16) peaks from the vendors' data sheets, TFLOP/s; the first name found in the device name wins.
PEAK_BF16_TFLOPS = {
    "H200 NVL": 835,
    "H200": 989,
    "H100 PCIe": 756,
    "H100 NVL": 835,
    "H100": 989,
    "A100": 312,
    "L40S": 362,
    "L40": 181,
    "A10G": 70,
    "L4": 121,
}


def peak_tflops(device_name: str) -> float | None:
    return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if name in device_name), None)


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The data-sheet peak of this GPU for bf16/fp16 training; None on a CPU, in fp32 or for an unknown GPU."""
    if device.type != "cuda" or precision == "fp32":
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


def flops_per_token(model: nn.Module, block_size: int) -> float:
    """Training FLOPs per token of the built-in GPT or a Hugging Face causal LM (a transformers PreTrainedModel). Of an
    MoE, only the experts a token is routed to multiply: transformers 5 keeps each layer's experts in 3-D parameters
    (experts x ...), of which num_experts_per_tok / experts count."""
    if isinstance(model, GPT):
        layers, width = len(model.blocks), model.wte.embedding_dim
        lookups, head = [model.wte, model.wpe], model.lm_head
        active = 1.0
    else:
        hf: Any = model  # a transformers PreTrainedModel
        layers, width = hf.config.num_hidden_layers, hf.config.hidden_size
        lookups, head = [hf.get_input_embeddings()], hf.get_output_embeddings()
        active = routed_share(hf.config)
    looked_up = {id(p) for table in lookups for p in table.parameters()}
    multiplied = sum(
        p.numel() * (active if p.dim() == 3 else 1.0) for p in model.parameters() if id(p) not in looked_up
    )
    if head is not None:  # an output head tied to the embedding multiplies too (model.parameters() lists it once)
        multiplied += sum(p.numel() for p in head.parameters() if id(p) in looked_up)
    return 6 * multiplied + 12 * layers * width * block_size


def routed_share(config) -> float:
    """The share of an MoE's experts each token runs (num_experts_per_tok of them); 1 for a dense model."""
    per_token = getattr(config, "num_experts_per_tok", None)
    experts = next(
        (
            getattr(config, key)
            for key in ("num_local_experts", "num_experts", "n_routed_experts")
            if hasattr(config, key)
        ),
        None,
    )
    return per_token / experts if per_token and experts else 1.0


def mfu(items_per_s: float, flops_per_item: float, devices: int, peak: float | None) -> float | None:
    """The fraction of `devices` x `peak` TFLOP/s that training at `items_per_s` (tokens or samples, all devices)
    uses."""
    return None if not peak else items_per_s * flops_per_item / (devices * peak * 1e12)


def counted_flops(m: ModelConfig, loss_of: Callable[[nn.Module], torch.Tensor]) -> tuple[float | None, str]:
    """The FLOPs PyTorch's FlopCounterMode counts in the forward and backward of `loss_of(model)`, the model that
    model section `m` describes built on the meta device: matrix products, convolutions and attention, what
    dominates training (elementwise work is left out, as in 6N). (None, why) where they cannot be counted."""
    from torch.utils.flop_counter import FlopCounterMode

    from distsetup.training.model.build import architecture_on_meta

    try:
        model = architecture_on_meta(m)  # built before counting: a builder's own work is no training FLOP
        with FlopCounterMode(display=False) as counter:
            loss_of(model).backward()
    except Exception as e:
        return None, f"{type(e).__name__}: {first_line(e)}"
    return float(counter.get_total_flops()), ""

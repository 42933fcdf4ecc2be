"""FSDP2's mixed-precision policies: the units' (training.precision, the FSDP file's reduce dtype), the root's, and
those of the layers that keep running statistics, each a unit of its own in fp32 where the weights are 16-bit."""

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from distsetup.errors import DistsetupError
from distsetup.training.backends.precision import PRECISION_DTYPES
from distsetup.training.model.build import Description
from distsetup.training.model.running_statistics import keeps_running_statistics


@dataclasses.dataclass(frozen=True)
class FsdpPrecision:
    precision: str  # the run's: fp32 or bf16 (FSDP2 trains no fp16)
    reduce_dtype: str | None  # the FSDP file's, a torch dtype's name; None: fp32
    loss_takes_outputs: bool  # training.loss (the user's) takes the model's outputs

    @property
    def sixteen_bit(self) -> bool:
        return self.precision != "fp32"

    def units(self) -> MixedPrecisionPolicy:
        if not self.sixteen_bit:
            return MixedPrecisionPolicy()
        reduce = getattr(torch, self.reduce_dtype or "float32")
        return MixedPrecisionPolicy(param_dtype=PRECISION_DTYPES[self.precision], reduce_dtype=reduce)

    def root(self) -> MixedPrecisionPolicy:
        """As the units', and where training.loss takes the model's outputs from 16-bit weights, those outputs in
        fp32, as Accelerate hands them on (convert_outputs_to_fp32) and as the fp32 targets of the batch meet them
        under autocast (single, DDP): a loss mixing the two would stop at the first step."""
        if not (self.sixteen_bit and self.loss_takes_outputs):
            return self.units()
        return dataclasses.replace(self.units(), output_dtype=torch.float32)

    def norms(self) -> MixedPrecisionPolicy:
        """A fp32 norm unit's: as the units', but its input cast to fp32, its weights kept so, its output cast back."""
        output = PRECISION_DTYPES[self.precision]
        return dataclasses.replace(self.units(), param_dtype=torch.float32, output_dtype=output)

    def norms_in_fp32(self, model: nn.Module, left_out: set[int]) -> list[nn.Module]:
        """The layers that keep running statistics, other than those with ids in `left_out`, where the weights are
        16-bit: their statistics are fp32 buffers, which FSDP2 never casts, and a BatchNorm's 16-bit weight beside
        them stops its forward on the CPU (autocast runs batch_norm in fp32; FSDP1's MixedPrecision kept BatchNorm in
        fp32 by default). Statistics are kept in fp32 and updated from fp32 inputs alike, whatever the layer."""
        if not self.sixteen_bit:
            return []
        return [m for m in model.modules() if keeps_running_statistics(m) and id(m) not in left_out]

    def check(self, description: Description, activation_checkpointing: str | None) -> None:
        """Before the process group: fp32 norm units under selective recompute, which cannot recompute a unit's
        gathers (its own hooks run ops the recompute does not repeat)."""
        norms = sorted(description.running_statistics_classes)
        if norms and self.sixteen_bit and activation_checkpointing == "selective":
            raise DistsetupError(
                f"training.activation_checkpointing selective with {', '.join(norms)} in {self.precision}: FSDP2 "
                "keeps each layer with running statistics in fp32, a unit of its own, and selective checkpointing "
                "cannot recompute a unit's gathers inside a block.",
                "set training.activation_checkpointing: full, or training.precision: fp32.",
            )

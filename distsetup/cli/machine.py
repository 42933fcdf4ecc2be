"""What `distsetup init` can tell about the machine it runs on, for the defaults of its questions: the GPUs
(through NVML), a SLURM allocation (its environment variables) and the active Python environment."""

import os
from dataclasses import dataclass, field

from distsetup.errors import DistsetupError
from distsetup.planning.gpus import GpuInfo, query_gpus


@dataclass(frozen=True)
class Machine:
    gpus: tuple[GpuInfo, ...] = ()
    no_gpu_reason: str | None = None  # why none were found (NVML's answer)
    slurm: dict[str, str] = field(default_factory=dict)  # SLURM_* of an allocation this runs inside
    venv: str | None = None  # $VIRTUAL_ENV
    cpu_count: int = 1

    @property
    def in_slurm_job(self) -> bool:
        return "SLURM_JOB_ID" in self.slurm

    @property
    def gpu_memory(self) -> float | None:
        """Bytes of the smallest GPU: what every rank can count on."""
        return min(g.memory_total for g in self.gpus) if self.gpus else None

    @property
    def precision(self) -> str:
        """bf16 where every GPU computes in it (or NVML did not say), fp16 on older GPUs, fp32 on CPUs."""
        if not self.gpus:
            return "fp32"
        return "fp16" if any(g.supports_bf16 is False for g in self.gpus) else "bf16"

    def slurm_count(self, name: str) -> int | None:
        """A positive count from the allocation (SLURM_JOB_NUM_NODES, SLURM_GPUS_ON_NODE), if it has one."""
        value = self.slurm.get(name, "")
        return int(value) if value.isdigit() and int(value) > 0 else None


def this_machine() -> Machine:
    try:
        gpus, reason = tuple(query_gpus()), None
    except DistsetupError as e:  # no driver, no NVML library, no device: a CPU machine
        gpus, reason = (), e.problem
    return Machine(
        gpus=gpus,
        no_gpu_reason=reason,
        slurm={k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
        venv=os.environ.get("VIRTUAL_ENV") or None,
        cpu_count=os.cpu_count() or 1,
    )

"""GPU listing and selection through NVML (`nvidia-ml-py`, imported lazily).

`select_gpus` is what `distsetup launcher --gpus auto:N` and `distsetup status` use. It returns NVML
indices, which follow PCI bus order: set `CUDA_DEVICE_ORDER=PCI_BUS_ID` together with
`CUDA_VISIBLE_DEVICES` so CUDA numbers the devices the same way.

Everything below `query_gpus` is pure: `choose_gpus` ranks `GpuInfo` records, so it is tested with
fake data. `query_gpus(nvml=...)` takes any object with pynvml's functions (a fake in the tests).
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path

from distsetup.errors import DistsetupError

GIB = 1024**3


class NoGpuError(DistsetupError):
    """No NVIDIA driver, no NVML library or no GPU on this machine."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it; memory in bytes, utilisation in percent."""

    index: int
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    utilization: int | None
    processes: tuple[GpuProcess, ...] = field(default=())
    compute_capability: tuple[int, int] | None = None  # (8, 0) for A100: bf16 from 8.0 on

    @property
    def supports_bf16(self) -> bool | None:
        """Whether the GPU computes in bfloat16 (Ampere and later); None when NVML did not say."""
        return None if self.compute_capability is None else self.compute_capability >= (8, 0)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    """A GPU with the reason it does or does not pass selection."""

    gpu: GpuInfo
    ok: bool
    reason: str


def _load_nvml():
    try:
        import pynvml
    except ImportError:
        if not Path("/proc/driver/nvidia/version").exists():
            raise NoGpuError(
                "no NVIDIA GPU found: no NVIDIA driver is loaded on this machine (and nvidia-ml-py is not installed).",
                "run on a GPU node, or train on CPU (backend ddp with gloo).",
            )
        raise DistsetupError(
            "an NVIDIA driver is loaded but nvidia-ml-py is not installed.",
            "pip install nvidia-ml-py (or: pip install 'distsetup[gpu]').",
        )
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def query_gpus(nvml=None) -> list[GpuInfo]:
    """Every NVIDIA GPU with memory, utilisation and processes; NoGpuError when there is none."""
    nvml = nvml or _load_nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise NoGpuError(
            f"no NVIDIA GPU found: NVML cannot start ({_text(e)}); no NVIDIA driver on this machine.",
            "run on a GPU node, or train on CPU (backend ddp with gloo).",
        ) from None
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise NoGpuError(
                "no NVIDIA GPU found: the driver is loaded but reports 0 devices.",
                "check `nvidia-smi` and CUDA_VISIBLE_DEVICES.",
            )
        return [_query_one(nvml, i) for i in range(count)]
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _query_one(nvml, index: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nvml.NVMLError:  # not supported on some devices (e.g. MIG instances)
        utilization = None
    processes = []
    try:
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:
        running = []
    for proc in running:
        try:
            name = _text(nvml.nvmlSystemGetProcessName(proc.pid))
        except nvml.NVMLError:
            name = "?"
        used = getattr(proc, "usedGpuMemory", None)
        processes.append(GpuProcess(int(proc.pid), name, int(used) if used is not None else None))
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        capability: tuple[int, int] | None = (int(major), int(minor))
    except (nvml.NVMLError, AttributeError):  # an old driver (or a fake NVML) without the call
        capability = None
    return GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_total=int(memory.total),
        memory_used=int(memory.used),
        memory_free=int(memory.free),
        utilization=utilization,
        processes=tuple(processes),
        compute_capability=capability,
    )


def judge_gpus(gpus: list[GpuInfo], min_free_gb: float = 16, max_util: float = 90) -> list[Verdict]:
    """Every GPU with whether it qualifies; qualifying ones first, ranked by free memory (then index)."""
    verdicts = []
    for gpu in gpus:
        free_gb = gpu.memory_free / GIB
        if free_gb < min_free_gb:
            verdicts.append(Verdict(gpu, False, f"{free_gb:.1f} GiB free < {min_free_gb:g}"))
        elif gpu.utilization is not None and gpu.utilization >= max_util:
            verdicts.append(Verdict(gpu, False, f"utilisation {gpu.utilization}% >= {max_util:g}%"))
        else:
            verdicts.append(Verdict(gpu, True, f"{free_gb:.1f} GiB free"))
    return sorted(verdicts, key=lambda v: (not v.ok, -v.gpu.memory_free, v.gpu.index))


def choose_gpus(
    gpus: list[GpuInfo], count: int, min_free_gb: float = 16, max_util: float = 90, allow_fewer: bool = False
) -> list[int]:
    """The `count` best qualifying GPU indices (most free memory first)."""
    if count < 1:
        raise DistsetupError(f"asked for {count} GPUs.", "ask for at least 1.")
    verdicts = judge_gpus(gpus, min_free_gb, max_util)
    chosen = [v.gpu.index for v in verdicts if v.ok][:count]
    if len(chosen) < count and not (allow_fewer and chosen):
        rejected = "; ".join(f"GPU {v.gpu.index}: {v.reason}" for v in verdicts if not v.ok) or "none rejected"
        raise DistsetupError(
            f"asked for {count} GPUs but only {len(chosen)} of {len(gpus)} have at least {min_free_gb:g} GiB "
            f"free and utilisation under {max_util:g}% ({rejected}).",
            "free some GPUs, lower --min_free_gb / raise --max_util, or pass --allow_fewer.",
        )
    return chosen


def select_gpus(count: int, min_free_gb: float = 16, max_util: float = 90, allow_fewer: bool = False) -> list[int]:
    """Indices of `count` GPUs of this machine that pass selection, most free memory first.

    Raises DistsetupError when fewer qualify (unless allow_fewer, which returns at least one), and
    NoGpuError (a DistsetupError) when there is no NVIDIA driver or GPU.
    """
    return choose_gpus(query_gpus(), count, min_free_gb, max_util, allow_fewer)

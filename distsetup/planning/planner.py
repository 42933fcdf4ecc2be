"""The strategy search: every strategy estimated, and the fastest that fits chosen (no offload and no recomputation
first), with the largest micro-batch that fits and divides the per-rank batch; or, when nothing fits, what would."""

from dataclasses import asdict, dataclass, field, replace

from distsetup.errors import DistsetupError
from distsetup.formats.batch import global_batch_of, per_rank_batch
from distsetup.planning.estimates import BY_KEY, STRATEGIES, Estimate, Hardware, Strategy, Workload, estimate
from distsetup.planning.models import ModelShape
from distsetup.planning.units import GB


def _per_rank(hw: Hardware, work: Workload) -> int | None:
    """Samples per rank per optimizer step, or None without a global batch."""
    if work.global_batch_size is None:
        return None
    return per_rank_batch(work.global_batch_size, hw.num_nodes, hw.gpus_per_node)


def largest_micro_batch(
    strategy: Strategy, model: ModelShape, hw: Hardware, work: Workload, checkpointing: bool, limit: int = 4096
) -> int:
    """The largest micro-batch that fits (0 if not even 1 does); divides the per-rank batch when known."""
    per_rank = _per_rank(hw, work)
    cap = per_rank if per_rank is not None else limit
    lo, hi = 0, cap
    while lo < hi:  # memory grows with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        if estimate(strategy, model, hw, work, mid, checkpointing).fits:
            lo = mid
        else:
            hi = mid - 1
    if per_rank is not None:
        while lo and per_rank % lo:
            lo -= 1
    return lo


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    hardware: Hardware
    workload: Workload
    estimates: list[Estimate]  # every strategy at the asked (or chosen) micro-batch
    choice: Estimate | None
    micro_batch: int | None
    accumulation: int | None
    global_batch: int | None
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "model": asdict(self.model),
            "hardware": {**asdict(self.hardware), "world_size": self.hardware.world_size},
            "workload": asdict(self.workload),
            "estimates": [e.to_dict() for e in self.estimates],
            "recommendation": None
            if self.choice is None
            else {
                "strategy": self.choice.strategy,
                "label": self.choice.label,
                "activation_checkpointing": self.choice.activation_checkpointing,
                "micro_batch_size": self.micro_batch,
                "gradient_accumulation_steps": self.accumulation,
                "global_batch_size": self.global_batch,
                "total_bytes": self.choice.total,
            },
            "advice": self.advice,
        }


def candidates(hw: Hardware, allowed: tuple[str, ...] | None = None) -> list[Strategy]:
    """Strategies in order of preference; hybrid shard only across nodes, where it saves inter-node traffic."""
    order = [s for s in STRATEGIES if allowed is None or s.key in allowed]
    if hw.world_size == 1:
        order = [s for s in order if s.key == "ddp" or s.offload]
    if hw.num_nodes == 1:
        order = [s for s in order if s.key != "fsdp_hybrid_shard"]
    return order


def plan(model: ModelShape, hw: Hardware, work: Workload, allowed: tuple[str, ...] | None = None) -> Plan:
    """Estimate every strategy and pick the fastest that fits: no offload and no recomputation first."""
    per_rank = _per_rank(hw, work)
    if per_rank is not None and work.micro_batch_size and per_rank % work.micro_batch_size:
        raise DistsetupError(
            f"--micro_batch_size {work.micro_batch_size} does not divide the per-GPU batch "
            f"{per_rank} (global {work.global_batch_size} / {hw.world_size} GPUs).",
            "choose a micro-batch that divides it, or leave it out to let the planner pick.",
        )
    shown_micro = work.micro_batch_size or 1
    estimates = [estimate(s, model, hw, work, shown_micro) for s in STRATEGIES]
    order = candidates(hw, allowed)
    tiers = (
        [(s, False) for s in order if not s.offload]
        + [(s, True) for s in order if not s.offload]
        + [(s, ac) for s in order if s.offload for ac in (False, True)]
    )
    for strategy, checkpointing in tiers:
        if work.micro_batch_size:
            micro = work.micro_batch_size
            if not estimate(strategy, model, hw, work, micro, checkpointing).fits:
                continue
        else:
            micro = largest_micro_batch(strategy, model, hw, work, checkpointing)
            if micro == 0:
                continue
        accumulation = per_rank // micro if per_rank is not None else 1
        choice = estimate(strategy, model, hw, work, micro, checkpointing)
        advice = []
        best = largest_micro_batch(strategy, model, hw, work, checkpointing)
        if work.micro_batch_size and best > micro:
            advice.append(
                f"micro-batch up to {best} fits with {strategy.label}"
                + (f" (gradient accumulation {per_rank // best})" if per_rank else "")
                + "."
            )
        global_batch = global_batch_of(micro, accumulation, hw.world_size)
        return Plan(model, hw, work, estimates, choice, micro, accumulation, global_batch, advice)
    return Plan(
        model, hw, work, estimates, None, None, None, work.global_batch_size, what_would_fit(model, hw, work, allowed)
    )


def what_would_fit(
    model: ModelShape, hw: Hardware, work: Workload, allowed: tuple[str, ...] | None = None
) -> list[str]:
    """When nothing fits: a smaller micro-batch, more GPUs, NVMe offload, or model parallelism; or, on a GPU whose
    usable memory the runtime alone takes, a GPU's memory to give."""
    usable = hw.gpu_memory * (1 - hw.headroom)
    if usable <= hw.runtime_bytes:
        return [
            f"a GPU of {hw.gpu_memory / GB:g} GB leaves {usable / GB:.2f} GB usable, less than the "
            f"{hw.runtime_bytes / GB:.1f} GB each process takes before any model (CUDA context, communication "
            "buffers): give the GPUs' memory with its unit (e.g. 80GB)."
        ]
    advice = []
    one = replace(work, micro_batch_size=1, global_batch_size=None)
    if (work.micro_batch_size or 1) > 1:
        for s in candidates(hw, allowed):
            if estimate(s, model, hw, one, 1, True).fits:
                advice.append(
                    f"a smaller micro-batch: {s.label} fits micro-batch 1 with activation "
                    "checkpointing (raise gradient accumulation to keep the global batch)."
                )
                break
    sharding = [key for key in ("zero3", "fsdp_full_shard") if allowed is None or key in allowed] or list(allowed or ())
    for nodes in (2, 4, 8, 16, 32, 64, 128, 256):
        bigger = replace(hw, num_nodes=hw.num_nodes * nodes)
        for key in sharding:
            if estimate(BY_KEY[key], model, bigger, one, 1, True).fits:
                advice.append(
                    f"more GPUs: {BY_KEY[key].label} fits micro-batch 1 on {bigger.num_nodes} nodes x "
                    f"{hw.gpus_per_node} GPUs ({bigger.world_size} GPUs)."
                )
                break
        else:
            continue
        break
    gpu_only = estimate(BY_KEY["zero3_offload_all"], model, replace(hw, cpu_memory=None), one, 1, True)
    if gpu_only.fits:
        advice.append(
            "offload to NVMe: ZeRO-3 with optimizer and parameters on NVMe needs only "
            f"{gpu_only.total / GB:.1f} GB per GPU (--offload_optimizer nvme --offload_param nvme "
            "--nvme_path /local/nvme)."
        )
    if not advice:
        advice.append(
            "even one layer with micro-batch 1 does not fit a GPU: the model needs tensor or "
            "pipeline parallelism (Megatron-LM, DeepSpeed pipeline), or a shorter sequence."
        )
    return advice

"""Per-GPU memory and communication of each data-parallel strategy, and the one to use: pure arithmetic.

Bytes are decimal (1 GB = 1e9 B, as the ZeRO paper and GPU vendors write them). P = parameters,
N = ranks a state is sharded over, e = bytes per element of the compute dtype (2 for bf16/fp16, 4 fp32).

Model states per GPU (what each strategy holds between steps, plus the fp32 gradient DeepSpeed makes):

  strategy                params        grads           fp32 grads   optimizer (master + Adam m, v)
  DDP (torch)             4P            4P (+4P bucket)  -            8P
  ZeRO-1                  eP            eP              4P/N         12P/N
  ZeRO-2                  eP            eP/N            4P/N         12P/N
  ZeRO-2 + opt offload    eP            - (buckets)     - (CPU)      - (CPU: 16P/N per rank)
  ZeRO-3                  eP/N          eP/N            4P/N         12P/N       + 2eL gathered
  ZeRO-3 + opt offload    eP/N          - (buckets)     - (CPU)      - (CPU)     + 2eL gathered
  ZeRO-3 + opt/param off  - (CPU: eP/N) - (buckets)     - (CPU)      - (CPU)     + 2eL gathered
  FSDP2 full / hybrid     4P/N          4P/N            -            8P/N        + 3eL gathered
  FSDP2 shard-grad-op     4P/N + eP     4P/N            -            8P/N        (unsharded after forward)

L = the largest module's own parameters (ZeRO-3 gathers module by module); FSDP gathers whole blocks
(B) and keeps its root unit (R: embeddings, head) gathered: 3eL there stands for eR + 3eB.
For hybrid shard N is the GPUs of one node. DeepSpeed keeps an fp32 master copy of its partition even for
fp32 models, so its optimizer column is 12P/N at every precision; the ZeRO paper's K=12 with mixed precision gives
DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N (without the fp32 gradient and gathered
layers, which DeepSpeed's own estimators add: 2P + 18P/N at stage 2).

Activations per micro-batch (Korthikanti et al. 2022, "Reducing Activation Recomputation"): each
transformer layer keeps s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations; the a*s^2 attention-score
term is absent with fused (flash / SDPA) attention; fp32 doubles it. The loss keeps the fp32
log-softmax of the logits (4*s*b*V) and backward adds their gradient ((4 + e)*s*b*V); computed a slice of
W ids at a time (training.chunked_loss, loss_slices.py) it keeps 12 bytes a position (the log-sum-exp and the
target) and adds two fp32 slices (8*s*b*W) and the fp32 gradient of the head's input (4*s*b*h). With activation
checkpointing each layer keeps only its input (s*b*h*e) and one layer's full activations exist during
its recomputation.

Communication per step relative to DDP's all-reduce of 2P elements: ZeRO-1/2 and shard-grad-op 1x
(reduce-scatter + all-gather), ZeRO-3 and full shard 1.5x (parameters gathered in forward and again in
backward); hybrid shard 1.5x inside a node but only 1/G of DDP's volume between nodes.
"""

import math
import re
from dataclasses import asdict, dataclass, field, replace

from distsetup.errors import DistsetupError
from distsetup.formats.fsdp import FLAG_FOR_PRECISION
from distsetup.planning import loss_slices

GB = 1e9
SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
MEMORY_UNITS = {
    "": GB,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce/allgather bucket (elements)
DS_PREFETCH_BUCKET = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size (elements)
RUNTIME_BYTES = 1.0 * GB  # CUDA context, NCCL buffers, allocator slack (GPU only)
MAX_PARAMS = 10**15  # a thousand times the largest models: beyond it, a typo
MAX_BATCH = 10**9  # samples per step: more is a typo (and overflows the activation arithmetic)


def _number(text: str) -> float | None:
    """A finite number from the digits of a size, or None ('1.2.3', '1e999')."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_count(text: str, flag: str = "--params") -> int:
    """'7B', '1.3e9', '350M' -> a parameter count, at least 1 and at most MAX_PARAMS."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMBGT]?)\s*", str(text), re.IGNORECASE)
    value = _number(match.group(1)) if match else None
    if match is None or value is None:
        raise DistsetupError(f"{flag}: cannot read '{text}' as a parameter count.", "write e.g. 7B, 350M or 1.3e9.")
    count = int(value * SUFFIXES[match.group(2).upper()])
    if not 1 <= count <= MAX_PARAMS:
        raise DistsetupError(
            f"{flag} {text} is {count:,} parameters.",
            f"give a count from 1 to {MAX_PARAMS:.0e} (the largest models have about 2e12).",
        )
    return count


def parse_memory(text: str, flag: str = "--gpu_memory") -> float:
    """'80GB', '80GiB', '80' (GB) -> bytes, more than none."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B?)\s*", str(text), re.IGNORECASE)
    value = _number(match.group(1)) if match and match.group(2).upper() in MEMORY_UNITS else None
    if match is None or value is None:
        raise DistsetupError(f"{flag}: cannot read '{text}' as an amount of memory.", "write e.g. 80GB or 24GiB.")
    if value <= 0:
        raise DistsetupError(f"{flag} {text} is no memory at all.", "give the memory of one device, e.g. 80GB.")
    return value * MEMORY_UNITS[match.group(2).upper()]


# Published decoder shapes (GPT-3 paper Table 2.1; Llama 2 for 7B-70B): params, hidden, layers, heads, vocab.
KNOWN_SHAPES = [
    (125e6, 768, 12, 12, 50257),
    (350e6, 1024, 24, 16, 50257),
    (760e6, 1536, 24, 16, 50257),
    (1.3e9, 2048, 24, 16, 50257),
    (2.7e9, 2560, 32, 32, 50257),
    (6.7e9, 4096, 32, 32, 32000),
    (13e9, 5120, 40, 40, 32000),
    (33e9, 6656, 60, 52, 32000),
    (70e9, 8192, 80, 64, 32000),
    (175e9, 12288, 96, 96, 50257),
]


def assumed_shape(params: int) -> tuple[int, int, int, int]:
    """(hidden, layers, heads, vocab) of the published model nearest in size: a stand-in for activations."""
    return min(KNOWN_SHAPES, key=lambda shape: abs(math.log(shape[0] / params)))[1:]


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model; hidden/layers/vocab only matter for activations."""

    params: int
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    block_params: int | None = None  # one transformer block; default 12h^2 + 13h
    largest_module_params: int | None = None  # largest module's own parameters (ZeRO-3 gathers per module)
    layer_cls: str = "Block"

    @property
    def block(self) -> int:
        if self.block_params is not None:
            return self.block_params
        if self.hidden_size:
            return 12 * self.hidden_size**2 + 13 * self.hidden_size
        return self.params // max(self.num_layers or 1, 1)

    @property
    def root(self) -> int:
        """Parameters outside the blocks (embeddings, final norm, head): FSDP's root unit."""
        return max(self.params - self.block * (self.num_layers or 0), 0) if self.num_layers else 0

    @property
    def largest_module(self) -> int:
        if self.largest_module_params is not None:
            return self.largest_module_params
        if self.hidden_size:
            h = self.hidden_size
            return max(4 * h * h + 4 * h, (self.vocab_size or 0) * h)
        return self.block


def gpt_params(vocab_size: int, block_size: int, n_layer: int, n_embd: int, tied: bool = False) -> int:
    """Parameters of a GPT-2 style model with biases and learned positions (analytic count)."""
    h = n_embd
    per_layer = 12 * h * h + 13 * h  # qkv, proj, fc, fc-proj weights + biases, two LayerNorms
    head = 0 if tied else vocab_size * h
    return n_layer * per_layer + vocab_size * h + block_size * h + 2 * h + head


@dataclass(frozen=True)
class Hardware:
    num_nodes: int = 1
    gpus_per_node: int = 1
    gpu_memory: float = 80 * GB
    cpu_memory: float | None = None  # per node; None = unknown (offload fit not judged)
    headroom: float = 0.1  # fraction of GPU memory kept free (fragmentation, spikes)
    runtime_bytes: float = RUNTIME_BYTES

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    precision: str = "bf16"  # fp32 | bf16 | fp16
    seq_len: int = 2048
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    flash_attention: bool = True
    chunked_loss: str = "auto"  # training.chunked_loss: auto, always or never


@dataclass(frozen=True)
class Strategy:
    key: str
    label: str
    framework: str  # ddp | deepspeed | fsdp
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    sharding_strategy: str | None = None
    comm: float = 1.0  # volume per step relative to DDP

    @property
    def offload(self) -> int:
        return int(self.offload_optimizer) + int(self.offload_param)

    @property
    def fsdp_sharding(self) -> str:
        """The FSDP sharding strategy; only FSDP strategies have one."""
        if self.sharding_strategy is None:
            raise ValueError(f"strategy {self.key} is not an FSDP strategy.")
        return self.sharding_strategy


# In order of expected speed when memory is no object: least communication, then least offload.
STRATEGIES = (
    Strategy("ddp", "DDP", "ddp"),
    Strategy("zero1", "ZeRO-1", "deepspeed", 1),
    Strategy("zero2", "ZeRO-2", "deepspeed", 2),
    Strategy("fsdp_shard_grad_op", "FSDP shard-grad-op", "fsdp", sharding_strategy="SHARD_GRAD_OP"),
    Strategy("fsdp_hybrid_shard", "FSDP hybrid shard", "fsdp", sharding_strategy="HYBRID_SHARD", comm=1.5),
    Strategy("zero3", "ZeRO-3", "deepspeed", 3, comm=1.5),
    Strategy("fsdp_full_shard", "FSDP full shard", "fsdp", sharding_strategy="FULL_SHARD", comm=1.5),
    Strategy("zero2_offload", "ZeRO-2 + optimizer offload", "deepspeed", 2, offload_optimizer=True),
    Strategy("zero3_offload_optimizer", "ZeRO-3 + optimizer offload", "deepspeed", 3, offload_optimizer=True, comm=1.5),
    Strategy(
        "zero3_offload_all",
        "ZeRO-3 + optimizer/param offload",
        "deepspeed",
        3,
        offload_optimizer=True,
        offload_param=True,
        comm=1.5,
    ),
)
BY_KEY = {s.key: s for s in STRATEGIES}


def element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU for one strategy; `activations*` are for `micro_batch` samples."""

    strategy: str
    label: str
    params: float
    grads: float
    fp32_grads: float
    optimizer: float
    gathered: float
    buffers: float
    activations: float
    activations_checkpointed: float
    cpu_per_node: float
    comm_vs_ddp: float
    inter_node_comm_vs_ddp: float
    micro_batch: int
    usable: float
    activation_checkpointing: bool = False
    fits: bool = False

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer states (what DeepSpeed's estimators count, less `gathered`)."""
        return self.params + self.grads + self.fp32_grads + self.optimizer

    @property
    def total(self) -> float:
        act = self.activations_checkpointed if self.activation_checkpointing else self.activations
        return self.model_states + self.gathered + self.buffers + act

    @property
    def headroom(self) -> float:
        return self.usable - self.total

    def to_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total, "headroom_bytes": self.headroom}


def model_states(strategy: Strategy, model: ModelShape, hw: Hardware, precision: str) -> dict:
    """Per-GPU bytes of parameters, gradients, fp32 gradients, optimizer states and gathered layers."""
    P, e = model.params, element_bytes(precision)
    n = hw.gpus_per_node if strategy.sharding_strategy == "HYBRID_SHARD" else hw.world_size
    out = dict(params=0.0, grads=0.0, fp32_grads=0.0, optimizer=0.0, gathered=0.0, buffers=0.0, cpu=0.0)
    if strategy.framework == "ddp":
        out.update(params=4 * P, grads=4 * P, optimizer=8 * P, buffers=4 * P)  # DDP's bucket copy of grads
    elif strategy.framework == "fsdp":
        # root unit (kept gathered through forward), current + prefetched block, one block's unsharded grads
        out.update(
            params=4 * P / n, grads=4 * P / n, optimizer=8 * P / n, gathered=e * model.root + 3 * e * model.block
        )
        if strategy.sharding_strategy == "SHARD_GRAD_OP":
            out["gathered"] = e * P + e * model.block  # kept unsharded from forward to backward
    else:
        stage = strategy.zero_stage
        out["params"] = e * P / n if stage == 3 else e * P
        out["grads"] = e * P if stage == 1 else e * P / n
        out["fp32_grads"], out["optimizer"] = 4 * P / n, 12 * P / n
        if stage == 3:
            out["gathered"] = 2 * e * model.largest_module  # DeepSpeed's estimator: 4L at 16 bit
            out["buffers"] = e * min(DS_PREFETCH_BUCKET, P)
        else:
            out["buffers"] = 2 * e * min(DS_REDUCE_BUCKET, P)  # reduce + all-gather buckets
        on_cpu = 0.0
        if strategy.offload_optimizer:
            on_cpu += out["fp32_grads"] + out["optimizer"]  # 16-bit grads are copied into the CPU fp32 ones
            out.update(fp32_grads=0.0, optimizer=0.0, grads=0.0)
        if strategy.offload_param:
            on_cpu += out["params"]
            out["params"] = 0.0
        out["cpu"] = on_cpu * hw.gpus_per_node
    if hw.runtime_bytes:
        out["buffers"] += hw.runtime_bytes
    return out


def activation_bytes(
    model: ModelShape, work: Workload, micro_batch: int, checkpointing: bool, peak: bool = True
) -> float:
    """Activation bytes per GPU: saved for backward, plus (peak=True) what exists only during backward.

    Saved: each layer's activations (or only its input with checkpointing), the final norm's and the
    head's inputs, and what the loss keeps: the fp32 log-softmax of the logits, or (sliced) a log-sum-exp and a
    target per position. Peak adds one layer's recomputed activations (checkpointing) and the loss's backward: the
    logits' gradient (fp32, then in the compute dtype), or two fp32 slices and the head input's fp32 gradient.
    """
    if not (model.hidden_size and model.num_layers):
        return 0.0
    s, b, h, layers = work.seq_len, micro_batch, model.hidden_size, model.num_layers
    a = model.num_heads or max(1, h // 128)
    e = element_bytes(work.precision)
    per_layer = s * b * h * (34 + (0 if work.flash_attention else 5 * a * s / h)) * e / 2
    head = 2 * s * b * h * e  # the final norm's input and the head's input
    loss_saved, loss_peak = loss_bytes(s * b, h, model.vocab_size or 0, e, work.chunked_loss)
    saved = (layers * s * b * h * e if checkpointing else layers * per_layer) + head + loss_saved
    if not peak:
        return saved
    return saved + (per_layer if checkpointing else 0) + loss_peak


def loss_bytes(positions: int, hidden: int, vocab: int, e: int, chunked_loss: str) -> tuple[float, float]:
    """(bytes the token loss keeps for backward, bytes its backward adds) for `positions` targets."""
    if not loss_slices.chunked(chunked_loss, vocab):
        return 4 * positions * vocab, (4 + e) * positions * vocab
    return 12 * positions, 8 * positions * loss_slices.slice_width(vocab) + 4 * positions * hidden


def estimate(
    strategy: Strategy, model: ModelShape, hw: Hardware, work: Workload, micro_batch: int, checkpointing: bool = False
) -> Estimate:
    states = model_states(strategy, model, hw, work.precision)
    comm_between_nodes = strategy.comm
    if strategy.sharding_strategy == "HYBRID_SHARD":
        comm_between_nodes = 1.0 / hw.gpus_per_node if hw.num_nodes > 1 else 0.0
    elif hw.num_nodes == 1:
        comm_between_nodes = 0.0
    est = Estimate(
        strategy=strategy.key,
        label=strategy.label,
        params=states["params"],
        grads=states["grads"],
        fp32_grads=states["fp32_grads"],
        optimizer=states["optimizer"],
        gathered=states["gathered"],
        buffers=states["buffers"],
        activations=activation_bytes(model, work, micro_batch, False),
        activations_checkpointed=activation_bytes(model, work, micro_batch, True),
        cpu_per_node=states["cpu"],
        comm_vs_ddp=strategy.comm,
        inter_node_comm_vs_ddp=comm_between_nodes,
        micro_batch=micro_batch,
        usable=hw.gpu_memory * (1 - hw.headroom),
        activation_checkpointing=checkpointing,
    )
    cpu_ok = hw.cpu_memory is None or est.cpu_per_node <= hw.cpu_memory * (1 - hw.headroom)
    return replace(est, fits=est.total <= est.usable and cpu_ok)


def per_rank_batch(hw: Hardware, work: Workload) -> int | None:
    """Samples per rank per optimizer step, or None without a global batch."""
    if work.global_batch_size is None:
        return None
    if work.global_batch_size % hw.world_size:
        raise DistsetupError(
            f"--global_batch_size {work.global_batch_size} is not divisible by the world size {hw.world_size}.",
            f"use a multiple of {hw.world_size}.",
        )
    return work.global_batch_size // hw.world_size


def largest_micro_batch(
    strategy: Strategy, model: ModelShape, hw: Hardware, work: Workload, checkpointing: bool, limit: int = 4096
) -> int:
    """The largest micro-batch that fits (0 if not even 1 does); divides the per-rank batch when known."""
    per_rank = per_rank_batch(hw, work)
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
    per_rank = per_rank_batch(hw, work)
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
        return Plan(
            model, hw, work, estimates, choice, micro, accumulation, micro * accumulation * hw.world_size, advice
        )
    return Plan(
        model, hw, work, estimates, None, None, None, work.global_batch_size, what_would_fit(model, hw, work, allowed)
    )


def what_would_fit(
    model: ModelShape, hw: Hardware, work: Workload, allowed: tuple[str, ...] | None = None
) -> list[str]:
    """When nothing fits: a smaller micro-batch, more GPUs, NVMe offload, or model parallelism."""
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
    for nodes in (2, 4, 8, 16, 32, 64, 128, 256):
        bigger = replace(hw, num_nodes=hw.num_nodes * nodes)
        for key in ("zero3", "fsdp_full_shard"):
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


def deepspeed_args(choice: Estimate, micro: int, accumulation: int, precision: str, world_size: int) -> list[str]:
    """The `distsetup deepspeed` arguments for a DeepSpeed recommendation."""
    s = BY_KEY[choice.strategy]
    args = ["--zero_stage", str(s.zero_stage)]
    if s.offload_optimizer:
        args.append("--offload_optimizer")
    if s.offload_param:
        args.append("--offload_param")
    if precision != "fp32":
        args.append(f"--{precision}")
    return args + [
        "--micro_batch_size",
        str(micro),
        "--gradient_accumulation_steps",
        str(accumulation),
        "--world_size",
        str(world_size),
    ]


def fsdp_args(choice: Estimate, precision: str, layer_cls: str) -> list[str]:
    """The `distsetup fsdp` arguments for an FSDP recommendation."""
    s = BY_KEY[choice.strategy]
    args = ["--sharding_strategy", s.fsdp_sharding, "--transformer_layer_cls_to_wrap", layer_cls]
    if precision != "fp32":
        args += ["--mixed_precision", FLAG_FOR_PRECISION[precision]]
    if choice.activation_checkpointing:
        args.append("--activation_checkpointing")
    return args


def gb(value: float) -> str:
    return f"{value / GB:.1f}"

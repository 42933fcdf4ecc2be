"""Per-GPU memory and communication of each data-parallel strategy: pure arithmetic.

Bytes are decimal (1 GB = 1e9 B, as the ZeRO paper and GPU vendors write them). P = parameters,
N = ranks a state is sharded over, e = bytes per element of the compute dtype (2 for bf16/fp16, 4 fp32).

Model states per GPU (what each strategy holds between steps, plus the fp32 gradient DeepSpeed makes):

  strategy                params        grads           fp32 grads   optimizer (master + Adam m, v)
  DDP (torch)             4P            4P (buckets)     -            8P
  ZeRO-1                  eP            eP              4P/N         12P/N
  ZeRO-2                  eP            eP/N            4P/N         12P/N
  ZeRO-2 + opt offload    eP            - (buckets)     - (CPU)      - (CPU: 16P/N per rank)
  ZeRO-3                  eP/N          eP/N            4P/N         12P/N       + 2eL gathered
  ZeRO-3 + opt offload    eP/N          - (buckets)     - (CPU)      - (CPU)     + 2eL gathered
  ZeRO-3 + opt/param off  - (CPU: eP/N) - (buckets)     - (CPU)      - (CPU)     + 2eL gathered
  FSDP2 full / hybrid     4P/N          4P/N            -            8P/N        + 3eL gathered
  FSDP2 shard-grad-op     4P/N + eP     4P/N            -            8P/N        (unsharded after forward)

L = the most ZeRO-3 gathers at once: a block (B: the trainer makes each a leaf module, gathered whole), or the
largest module outside them (the embedding); FSDP gathers whole blocks and keeps its root unit (R: embeddings, head)
gathered: 3eL there stands for eR + 3eB.
For hybrid shard N is the GPUs of one node. ZeRO 1-2 keep an fp32 master copy of their partition even for
fp32 models, so their optimizer column is 12P/N at every precision; ZeRO-3 training in fp32 (its optimizer not
offloaded) steps the partition itself, 8P/N (the trainer's zero3_master_weights). The ZeRO paper's K=12 with mixed
precision gives
DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N (without the fp32 gradient and gathered
layers, which DeepSpeed's own estimators add: 2P + 18P/N at stage 2).

ZeRO's buffers, where the file leaves them unset: DeepSpeed's own sizes where the GPU has room for them beside the
states (room_for_deepspeed_buffers, as the trainer decides), else sized from the hidden size (MODEL_SIZED).

The peak is the larger of two moments (measured within 5% on an H200, benchmarks/gpu_throughput.py, 1B GPT):
the end of forward, with every activation kept, the weights and optimizer states, torch.autocast's 16-bit copies of
fp32 weights (eP, DDP and one process), and gradients only where they outlive a step (DDP's buckets, ZeRO's 16-bit
partitions) or accumulate over micro-batches; and the optimizer step, with every model state (DeepSpeed makes its
fp32 gradients there, a sub-group at a time).

Set-up, in the host's memory: rank 0 alone builds the model whole in fp32 (4P), the others on the meta device
(nothing); its values fill the others' shards (FSDP2, ZeRO-3) or their whole copies on their devices (DDP, ZeRO 0-2:
training/model/from_rank0.py). The model goes to the GPU after: its GPU memory at set-up is what it holds between
steps, less than the training's peak.

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

from dataclasses import asdict, dataclass, replace

from distsetup.formats.deepspeed import DEEPSPEED_DEFAULTS, SIZED_BY_ROOM, model_sized
from distsetup.planning import loss_slices
from distsetup.planning.models import ModelShape
from distsetup.planning.units import GB

RUNTIME_BYTES = 1.0 * GB  # CUDA context, NCCL buffers, allocator slack (GPU only)


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
    def gathers_weights(self) -> bool:
        """Whether each step gathers the layers' weights from their shards and frees them again (FSDP's sharded
        strategies, ZeRO-3): large short-lived tensors of one size, layer after layer."""
        return self.zero_stage == 3 or self.framework == "fsdp"  # FSDP's NO_SHARD is planned as DDP

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


def zero_strategy(stage: int, offload_optimizer: bool, offload_param: bool) -> str:
    """The strategy holding what DeepSpeed's ZeRO stage `stage` holds (stage 0: whole, as DDP)."""
    if stage == 3:
        if offload_param:
            return "zero3_offload_all"
        return "zero3_offload_optimizer" if offload_optimizer else "zero3"
    if stage == 2:
        return "zero2_offload" if offload_optimizer else "zero2"
    return "zero1" if stage == 1 else "ddp"


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
    setup_rank0: float  # host bytes at set-up: rank 0's, each other rank's
    setup_others: float
    comm_vs_ddp: float
    inter_node_comm_vs_ddp: float
    micro_batch: int
    usable: float
    grads_in_forward: float = 0.0  # the gradients that exist while a forward runs (all of `grads` or none)
    autocast_weights: float = 0.0  # torch.autocast's 16-bit copies of fp32 weights, kept through forward
    activation_checkpointing: bool = False
    fits: bool = False
    host_fits: bool = True  # the node's host memory (--cpu_memory) holds its offloaded state and set-up
    keeps_deepspeed_sizes: bool = False  # ZeRO's buffers at DeepSpeed's sizes (zero_buffer), not the hidden size's

    def setup_per_node(self, gpus_per_node: int) -> float:
        """Host bytes at set-up on the node of rank 0."""
        return self.setup_rank0 + (gpus_per_node - 1) * self.setup_others

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer states (what DeepSpeed's estimators count, less `gathered`)."""
        return self.params + self.grads + self.fp32_grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak: at the end of forward (the activations all kept, gradients only where they outlive a step or
        accumulate), or in the optimizer step (every state, the fp32 gradients DeepSpeed makes for it included)."""
        act = self.activations_checkpointed if self.activation_checkpointing else self.activations
        forward_end = self.params + self.optimizer + self.grads_in_forward + self.autocast_weights + act
        return max(forward_end, self.model_states) + self.gathered + self.buffers

    @property
    def headroom(self) -> float:
        return self.usable - self.total

    def to_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total, "headroom_bytes": self.headroom}


def zero_buffer(key: str, model: ModelShape, room: bool) -> int:
    """Elements of ZeRO buffer `key` where a file leaves it unset, as the trainer fills it: DeepSpeed's own size
    where the rank has `room` for DeepSpeed's sizes (room_for_deepspeed_buffers) or the hidden size is unknown, else
    sized from the hidden size (formats.deepspeed.MODEL_SIZED)."""
    if model.hidden_size and not (room and key in SIZED_BY_ROOM):
        return model_sized(key, model.hidden_size)
    return DEEPSPEED_DEFAULTS[key]


def has_room(held_bytes: float, memory_bytes: float) -> bool:
    """Whether a rank of `memory_bytes` holds `held_bytes` (its training state, with what is kept for speed) in half of
    its memory, the other half for the activations and the runtime: the rule by which the trainer keeps what it may
    keep for speed where there is room (ZeRO's buffers at DeepSpeed's own sizes, the pages FSDP2's heap frees on a
    CPU) and gives it up where there is not."""
    return held_bytes <= memory_bytes / 2


def room_for_deepspeed_buffers(
    stage: int, params: int, state_bytes: float, memory_bytes: float, element_bytes: int
) -> bool:
    """Whether a rank of `memory_bytes` (its device's whole memory: the same figure on every rank and on every
    resume on the same kind of device) that holds `state_bytes` of training state has room for ZeRO's buffers at
    DeepSpeed's own sizes, beside the state in half of its memory (the other half for the activations and the
    runtime): at ZeRO-3 its reduce bucket (allocated whole) and the parameters it keeps gathered (the whole model, up
    to 1e9 elements; the prefetched ones among them), at ZeRO 1-2 two reduce buckets (overlap_comm's second). Where
    they fit, a file that leaves them unset means what DeepSpeed and the HF Trainer read it as, at DeepSpeed's pace;
    where they do not, they are sized from the model, so that a model bigger than one device still fits."""
    reduce = DEEPSPEED_DEFAULTS["reduce_bucket_size"]
    buffers = reduce + min(DEEPSPEED_DEFAULTS["stage3_max_live_parameters"], params) if stage == 3 else 2 * reduce
    return has_room(state_bytes + element_bytes * buffers, memory_bytes)


def device_state(states: dict) -> float:
    """Bytes of weights, gradients and optimizer states that model_states' `states` keep on the device (what is
    offloaded left out)."""
    return states["params"] + states["grads"] + states["fp32_grads"] + states["optimizer"]


def keeps_deepspeed_sizes(strategy: Strategy, model: ModelShape, hw: Hardware, precision: str) -> bool:
    """Whether ZeRO's buffers that a file leaves unset keep DeepSpeed's own sizes on `hw` (room_for_deepspeed_buffers):
    what the trainer asks, and what model_states counts."""
    states = model_states(strategy, model, hw, precision)
    return room_for_deepspeed_buffers(
        strategy.zero_stage, model.params, device_state(states), hw.gpu_memory, element_bytes(precision)
    )


def model_states(strategy: Strategy, model: ModelShape, hw: Hardware, precision: str) -> dict:
    """Per-GPU bytes of parameters, gradients, fp32 gradients, optimizer states and gathered layers."""
    P, e = model.params, element_bytes(precision)
    n = hw.gpus_per_node if strategy.sharding_strategy == "HYBRID_SHARD" else hw.world_size
    out = dict(params=0.0, grads=0.0, fp32_grads=0.0, optimizer=0.0, gathered=0.0, buffers=0.0, cpu=0.0)
    if strategy.framework == "ddp":
        out.update(params=4 * P, grads=4 * P, optimizer=8 * P)  # .grad aliases DDP's buckets (gradient_as_bucket_view)
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
        master = 0 if stage == 3 and e == 4 and not strategy.offload_optimizer else 4 * P / n  # the partition's own
        out["fp32_grads"], out["optimizer"] = 4 * P / n, master + 8 * P / n
        if stage == 3:
            out["gathered"] = 2 * e * model.zero3_unit  # DeepSpeed's estimator: 4L at 16 bit, L its largest unit
        on_cpu = 0.0
        if strategy.offload_optimizer:
            on_cpu += out["fp32_grads"] + out["optimizer"]  # 16-bit grads are copied into the CPU fp32 ones
            out.update(fp32_grads=0.0, optimizer=0.0, grads=0.0)
        if strategy.offload_param:
            on_cpu += out["params"]
            out["params"] = 0.0
        out["cpu"] = on_cpu * hw.gpus_per_node
        room = room_for_deepspeed_buffers(stage, P, device_state(out), hw.gpu_memory, e)
        reduce = zero_buffer("reduce_bucket_size", model, room)
        if stage == 3:  # the prefetch bucket, and the reduce bucket, allocated whole
            out["buffers"] = e * (min(zero_buffer("stage3_prefetch_bucket_size", model, room), P) + reduce)
        else:  # reduce + all-gather buckets
            out["buffers"] = e * (min(reduce, P) + min(DEEPSPEED_DEFAULTS["allgather_bucket_size"], P))
    if hw.runtime_bytes:
        out["buffers"] += hw.runtime_bytes
    return out


def grads_in_forward(strategy: Strategy, hw: Hardware, accumulation: int) -> bool:
    """Whether a forward runs beside the gradients. The trainer frees them after each step (set_to_none), so a step's
    first forward has none where each backward makes them anew: one process, and FSDP2's reduce-scatter. DDP's
    buckets (which .grad aliases) and ZeRO's 16-bit gradient partitions are allocated once and kept; gradients
    accumulated over micro-batches exist through the later forwards."""
    made_in_backward = strategy.framework == "fsdp" or (strategy.framework == "ddp" and hw.world_size == 1)
    return accumulation > 1 or not made_in_backward


def autocast_weight_bytes(strategy: Strategy, model: ModelShape, precision: str) -> float:
    """torch.autocast casts each fp32 weight once per forward and keeps the 16-bit copy until autocast exits: DDP and
    one process (FSDP2 casts per unit, through its mixed-precision policy; ZeRO's weights are 16-bit already)."""
    return element_bytes(precision) * model.params if strategy.framework == "ddp" and precision != "fp32" else 0.0


def setup_host_bytes(model: ModelShape) -> tuple[float, float]:
    """Host bytes of (rank 0, each other rank) at set-up: the model built whole in fp32 on rank 0 alone (the module's
    docstring), whatever the strategy."""
    return 4.0 * model.params, 0.0


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
    # Korthikanti et al.: attention 11 + norms 4, the MLP's (19 for GPT's), and without flash attention 5as/h
    attention = 15 + (0 if work.flash_attention else 5 * a * s / h)
    per_layer = s * b * h * (attention + model.mlp_activation_units) * e / 2
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
    accumulation = -(-(work.global_batch_size or 0) // (micro_batch * hw.world_size)) or 1
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
        setup_rank0=setup_host_bytes(model)[0],
        setup_others=setup_host_bytes(model)[1],
        comm_vs_ddp=strategy.comm,
        inter_node_comm_vs_ddp=comm_between_nodes,
        micro_batch=micro_batch,
        usable=hw.gpu_memory * (1 - hw.headroom),
        grads_in_forward=states["grads"] if grads_in_forward(strategy, hw, accumulation) else 0.0,
        autocast_weights=autocast_weight_bytes(strategy, model, work.precision),
        activation_checkpointing=checkpointing,
        keeps_deepspeed_sizes=strategy.framework == "deepspeed"
        and keeps_deepspeed_sizes(strategy, model, hw, work.precision),
    )
    host_peak = max(est.cpu_per_node, est.setup_per_node(hw.gpus_per_node))
    cpu_ok = hw.cpu_memory is None or host_peak <= hw.cpu_memory * (1 - hw.headroom)
    return replace(est, fits=est.total <= est.usable and cpu_ok, host_fits=cpu_ok)

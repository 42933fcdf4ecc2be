"""DeepSpeed's batch identity: train_batch_size = micro_batch * accumulation * world_size, and the world."""

import math
from dataclasses import dataclass

from distsetup.errors import DistsetupError

# The largest clusters have some tens of thousands of nodes and the densest nodes 8-72 GPUs: counts beyond
# these are typos (and a per-node list of 10^20 entries would never finish).
MAX_NODES = 100_000
MAX_PROCESSES_PER_NODE = 1024


@dataclass(frozen=True)
class BatchSizes:
    """Batch sizes as resolved; a value stays None when it cannot be known yet."""

    micro: int | None
    accumulation: int | None
    train_batch: int | None
    world_size: int | None


@dataclass(frozen=True)
class BatchNames:
    """How the three batch values are called where they come from."""

    micro: str
    accumulation: str
    train: str


FLAGS = BatchNames("--micro_batch_size", "--gradient_accumulation_steps", "--train_batch_size")
FILE_KEYS = BatchNames("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def global_batch_of(micro: int, accumulation: int, world_size: int) -> int:
    """The batch identity: samples per optimizer step = micro-batch x gradient accumulation x world size."""
    return micro * accumulation * world_size


def per_rank_batch(global_batch: int, num_nodes: int, per_node: int) -> int:
    """Samples per rank per optimizer step: a global batch the world size (nodes x processes per node) divides."""
    world = num_nodes * per_node
    if global_batch % world:
        raise DistsetupError(
            f"--global_batch_size {global_batch} is not divisible by the {world} processes ({num_nodes} node(s) "
            f"x {per_node}).",
            f"use a multiple of {world}.",
        )
    return global_batch // world


class BatchMismatch(ValueError):
    """No batch sizes satisfy train = micro x accumulation x world size. `message` says what is wrong with the
    train batch size (and follows its name); `fits` is a train batch size that would do."""

    def __init__(self, message: str, fits: int):
        super().__init__(message)
        self.message, self.fits = message, fits


def complete_batch(
    micro: int | None, accumulation: int | None, train: int | None, world_size: int, names: BatchNames = FILE_KEYS
) -> BatchSizes:
    """The batch values DeepSpeed derives from a file's (DeepSpeedConfig._set_batch_related_parameters): the
    missing ones of train = micro x accumulation x world size, an accumulation no value fixes being 1.
    Raises BatchMismatch where they cannot add up, and where neither train nor micro is given."""
    if train is None:
        if micro is None:
            raise BatchMismatch(f"is not set, and neither is {names.micro}", world_size)
        accumulation = 1 if accumulation is None else accumulation
        return BatchSizes(micro, accumulation, global_batch_of(micro, accumulation, world_size), world_size)
    if micro is None:
        known_name = None if accumulation is None else names.accumulation  # none: DeepSpeed's accumulation of 1
        accumulation = 1 if accumulation is None else accumulation
        micro = _other_factor(train, accumulation, world_size, known_name)
    elif accumulation is None:
        accumulation = _other_factor(train, micro, world_size, names.micro)
    product = global_batch_of(micro, accumulation, world_size)
    if product != train:
        raise BatchMismatch(
            f"{train} != {names.micro} {micro} x {names.accumulation} {accumulation} "
            f"x world size {world_size} = {product}",
            product,
        )
    return BatchSizes(micro, accumulation, train, world_size)


def _other_factor(train: int, known: int, world_size: int, known_name: str | None) -> int:
    """The batch value missing from train = known x missing x world size (`known_name` None: the known value is no
    one's, an accumulation of 1 that nothing gave)."""
    if train % (known * world_size):
        multiple = known * world_size
        factors = (
            f"{known_name} {known} x world size {world_size} = {multiple}" if known_name else f"world size {world_size}"
        )
        raise BatchMismatch(f"{train} is not divisible by {factors}", multiple * max(1, round(train / multiple)))
    return train // (known * world_size)


def resolve_batch(
    micro: int | None, accumulation: int | None, train_batch: int | None, world_size: int | None
) -> BatchSizes:
    """The batch sizes `distsetup deepspeed` writes for its flags: the third value from the other two, as DeepSpeed
    derives it (the train batch alone: an accumulation of 1, each process's micro-batch its share; the accumulation
    alone: a micro-batch of 1), or an error showing the arithmetic. No batch flag: none."""
    if micro is None and accumulation is None and train_batch is None:
        return BatchSizes(None, None, None, world_size)
    if world_size is None:
        _check_without_world_size(micro, accumulation, train_batch)
        return BatchSizes(micro, accumulation, None, None)
    if micro is None and train_batch is None:
        micro = 1
    try:
        return complete_batch(micro, accumulation, train_batch, world_size, FLAGS)
    except BatchMismatch as e:
        raise DistsetupError(
            f"batch sizes do not add up: {FLAGS.train} {e.message}.",
            f"give any two of the three batch values and distsetup computes the third (e.g. --train_batch_size "
            f"{e.fits}).",
        )


def _check_without_world_size(micro: int | None, accumulation: int | None, train_batch: int | None) -> None:
    """A train batch size needs the world size, and a multiple of the micro-batch values no world size breaks."""
    if train_batch is None:
        return
    known = [v for v in (micro, accumulation) if v is not None]
    product = math.prod(known)
    if known and train_batch % product:
        factors = " x ".join(
            f"{flag} {v}" for flag, v in ((FLAGS.micro, micro), (FLAGS.accumulation, accumulation)) if v is not None
        )
        raise DistsetupError(
            f"{FLAGS.train} {train_batch} is not a multiple of {factors}"
            + (f" = {product}" if len(known) > 1 else "")
            + ", so no world size gives it.",
            f"use a multiple of {product} (e.g. {product * max(1, round(train_batch / product))}).",
        )
    raise DistsetupError(
        f"{FLAGS.train} needs the world size: the batch identity train = micro x accumulation x world size only "
        "holds for one.",
        "add --world_size N (or --num_nodes and --num_gpus_per_node), or give --micro_batch_size "
        "and --gradient_accumulation_steps instead.",
    )


def check_world_counts(
    num_nodes: int | None,
    per_node: int | None,
    nodes_flag: str = "--num_nodes",
    per_node_flag: str = "--num_gpus_per_node",
) -> None:
    """Node and per-node process counts between 1 and MAX_NODES / MAX_PROCESSES_PER_NODE (None: not given)."""
    for flag, value, most, what, hint in (
        (nodes_flag, num_nodes, MAX_NODES, "cluster", "use --num_nodes 1 for one machine."),
        (per_node_flag, per_node, MAX_PROCESSES_PER_NODE, "node", "give the GPUs (or CPU processes) per node."),
    ):
        if value is not None and value < 1:
            raise DistsetupError(f"{flag} {value} must be at least 1.", hint)
        if value is not None and value > most:
            raise DistsetupError(
                f"{flag} {value} is more than {most:,}, more than any real {what} has.",
                f"give the real count (at most {most:,}).",
            )


def world_size_from(world_size: int | None, num_nodes: int | None, num_gpus_per_node: int | None) -> int | None:
    """The data-parallel world size from --world_size or --num_nodes x --num_gpus_per_node."""
    check_world_counts(num_nodes, num_gpus_per_node)
    if world_size is not None and world_size > MAX_NODES * MAX_PROCESSES_PER_NODE:
        raise DistsetupError(
            f"--world_size {world_size} is more than {MAX_NODES * MAX_PROCESSES_PER_NODE:,} "
            f"({MAX_NODES:,} nodes x {MAX_PROCESSES_PER_NODE:,} processes).",
            "give the real count.",
        )
    if num_nodes is None and num_gpus_per_node is None:
        return world_size
    if num_gpus_per_node is None:
        raise DistsetupError(
            f"--num_nodes {num_nodes} needs --num_gpus_per_node: the world size is nodes x GPUs.",
            "add --num_gpus_per_node G (or give --world_size).",
        )
    product = (num_nodes or 1) * num_gpus_per_node
    if world_size is not None and world_size != product:
        raise DistsetupError(
            f"--world_size {world_size} disagrees with --num_nodes {num_nodes or 1} x "
            f"--num_gpus_per_node {num_gpus_per_node or 1} = {product}.",
            "give either --world_size or the node and GPU counts.",
        )
    return product

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


def resolve_batch(
    micro: int | None, accumulation: int | None, train_batch: int | None, world_size: int | None
) -> BatchSizes:
    """Fill in the third batch value from the other two, or fail showing the arithmetic."""
    if world_size is None:
        known = [v for v in (micro, accumulation) if v is not None]
        if train_batch is not None and known and train_batch % math.prod(known):
            names = " x ".join(
                f"{flag} {v}"
                for flag, v in (("--micro_batch_size", micro), ("--gradient_accumulation_steps", accumulation))
                if v is not None
            )
            product = math.prod(known)
            raise DistsetupError(
                f"--train_batch_size {train_batch} is not a multiple of {names}"
                + (f" = {product}" if len(known) > 1 else "")
                + ", so no world size gives it.",
                f"use a multiple of {product} (e.g. {product * max(1, round(train_batch / product))}).",
            )
        if train_batch is not None:
            raise DistsetupError(
                "--train_batch_size needs the world size: the batch identity train = micro x accumulation "
                "x world size only holds for one.",
                "add --world_size N (or --num_nodes and --num_gpus_per_node), or give --micro_batch_size "
                "and --gradient_accumulation_steps instead.",
            )
        return BatchSizes(micro, accumulation, None, None)

    if train_batch is None:
        if micro is None or accumulation is None:  # at most one of the three given: the other is 1
            micro, accumulation = micro or 1, accumulation or 1
        train_batch = micro * accumulation * world_size
    elif accumulation is None:
        micro = 1 if micro is None else micro  # only the train batch given: micro-batch 1
        accumulation = _other_factor(train_batch, "--micro_batch_size", micro, world_size)
    elif micro is None:
        micro = _other_factor(train_batch, "--gradient_accumulation_steps", accumulation, world_size)
    if micro * accumulation * world_size != train_batch:
        raise DistsetupError(
            f"batch sizes do not add up: micro_batch {micro} x gradient_accumulation {accumulation} "
            f"x world_size {world_size} = {micro * accumulation * world_size}, "
            f"not train_batch_size {train_batch}.",
            "give any two of the three batch values and distsetup computes the third.",
        )
    return BatchSizes(micro, accumulation, train_batch, world_size)


def _other_factor(train_batch: int, name: str, known: int, world_size: int) -> int:
    """The batch value missing from train_batch = `known` (the value of option `name`) x missing x world size."""
    if train_batch % (known * world_size):
        raise DistsetupError(
            f"--train_batch_size {train_batch} is not divisible by {name} {known} x world size "
            f"{world_size} = {known * world_size}.",
            f"choose a train batch size that is a multiple of {known * world_size}.",
        )
    return train_batch // (known * world_size)


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

"""FSDP2 on the CPU gathers a layer where backward needs it, not one layer ahead (no prefetch: there is no stream to
overlap it with), and frees each reduce-scatter's input as soon as it is reduced. The gathers are seen on two ranks
(in a world of one FSDP2 gathers nothing); the reduce-scatter is called directly in a group of one. The memory this
saves is measured by benchmarks/scale_memory.py."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from repo import free_port
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.backends import fsdp_on_cpu
from distsetup.training.backends.fsdp import FSDPBackend
from distsetup.training.model.build import ModelParts
from distsetup.training.world import World


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Mark(torch.autograd.Function):
    """Identity; its backward, run in the middle of block `index`'s backward, notes that block in `events`."""

    @staticmethod
    def forward(ctx, x, index, events):
        ctx.index, ctx.events = index, events
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(f"block {ctx.index}")
        return grad, None, None


class Block(nn.Module):
    def __init__(self, index: int, events: list[str]):
        super().__init__()
        self.linear, self.index, self.events = nn.Linear(16, 16), index, events

    def forward(self, x):
        return torch.tanh(Mark.apply(self.linear(x), self.index, self.events))


class Stack(nn.Module):
    def __init__(self, events: list[str], blocks: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, events) for i in range(blocks))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


class NotedAllGather(DefaultAllGather):
    """FSDP2's own all-gather, noted in `events`."""

    def __init__(self, events: list[str]):
        self.events = events

    def __call__(self, *args, **kwargs):
        self.events.append("gather")
        return super().__call__(*args, **kwargs)


def backward_of_two_ranks(rank: int, port: int, results) -> None:
    """On each of 2 ranks: the events of one backward (gathers, blocks) and the gradients against a plain model's."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    events: list[str] = []
    plain, model = Stack([]), Stack(events)
    model.load_state_dict(plain.state_dict())
    cfg = load_run_config(None, ["distributed.backend=fsdp"])
    backend = FSDPBackend(cfg, World(rank=rank, local_rank=rank, size=2, local_size=2), torch.device("cpu"))
    backend.wrap(ModelParts(model, list(model.blocks), []), cfg.training.max_steps)
    for block in model.blocks:
        block.set_custom_all_gather(NotedAllGather(events))
    x = torch.randn(8, 16)  # the same on both ranks: the averaged gradients are the plain model's
    loss = model(x)
    events.clear()
    loss.backward()
    plain(x).backward()
    grads_match = all(
        torch.allclose(ours.grad.full_tensor(), theirs.grad)
        for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True)
    )
    results[rank] = (events, grads_match)
    dist.destroy_process_group()


def test_backward_gathers_a_block_where_it_is_needed_not_ahead_and_the_gradients_are_a_plain_models():
    results = mp.Manager().dict()
    mp.spawn(backward_of_two_ranks, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        events, grads_match = results[rank]
        # the last block stays gathered from its forward; FSDP2's default prefetch would gather block 2 before
        # block 3's backward, and so on: ["gather", "block 3", "gather", "block 2", "gather", "block 1", "block 0"]
        assert events == ["block 3", "gather", "block 2", "gather", "block 1", "gather", "block 0"], events
        assert grads_match


def test_the_reduce_scatter_reduces_and_frees_its_input():
    comm = fsdp_on_cpu.ReduceScatterFreeingItsInput()
    values = torch.arange(6.0)
    flat = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    flat.copy_(values)
    out = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    comm(output_tensor=out, input_tensor=flat, group=dist.group.WORLD, op=dist.ReduceOp.SUM)
    torch.testing.assert_close(out, values)  # a world of one: its own values
    assert flat.untyped_storage().nbytes() == 0

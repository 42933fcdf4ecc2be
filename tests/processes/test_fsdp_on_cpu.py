"""FSDP2 on the CPU gathers a layer where it is needed, not one layer ahead (there is no stream to overlap it with),
waits for each all-gather there (so forward frees its output once copied out), and frees each reduce-scatter's input
as soon as it is reduced. Seen on two spawned ranks (in a world of one FSDP2 gathers and reduces nothing); the
reduce-scatter is also called directly in a group of one. The memory this saves is measured by
benchmarks/scale_memory.py."""

import json
import os
from collections.abc import Callable
from pathlib import Path

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
from distsetup.training.launch_env import World
from distsetup.training.model.build import ModelParts


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Notes:
    """What a run notes: its events in order, and the bytes of the reduce-scatter inputs FSDP2 holds while each block's
    backward runs (`held`, once the model is sharded)."""

    def __init__(self):
        self.events: list[str] = []
        self.held: Callable[[], list[int]] | None = None
        self.held_bytes: list[int] = []


class Mark(torch.autograd.Function):
    """Identity; its backward, run in the middle of block `index`'s backward, notes that block."""

    @staticmethod
    def forward(ctx, x, index, notes):
        ctx.index, ctx.notes = index, notes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.notes.events.append(f"block {ctx.index}")
        if ctx.notes.held is not None:
            ctx.notes.held_bytes.extend(ctx.notes.held())
        return grad, None, None


class Block(nn.Module):
    def __init__(self, index: int, notes: Notes):
        super().__init__()
        self.linear, self.index, self.notes = nn.Linear(16, 16), index, notes

    def forward(self, x):
        return torch.tanh(Mark.apply(self.linear(x), self.index, self.notes))


class Stack(nn.Module):
    def __init__(self, notes: Notes, blocks: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, notes) for i in range(blocks))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


class NotedAllGather(DefaultAllGather):
    """FSDP2's own all-gather, noted in `events` ("gather", or "gather, waited later" where it is asynchronous, so
    that forward frees its output once copied out)."""

    def __init__(self, events: list[str]):
        self.events = events

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.events.append("gather, waited later" if async_op else "gather")
        return super().__call__(output_tensor, input_tensor, group, async_op)


def backward_of_two_ranks(rank: int, port: int, results) -> None:
    """On each of 2 ranks: the events of one backward (gathers, blocks) and the gradients against a plain model's."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    notes = Notes()
    plain, model = Stack(Notes()), Stack(notes)
    model.load_state_dict(plain.state_dict())
    cfg = load_run_config(None, ["distributed.backend=fsdp"])
    backend = FSDPBackend(cfg, World(rank=rank, local_rank=rank, size=2, local_size=2), torch.device("cpu"))
    backend.wrap(ModelParts(model, list(model.blocks), []), cfg.training.max_steps)
    for block in model.blocks:
        block.set_custom_all_gather(NotedAllGather(notes.events))
    # the reduce-scatter inputs FSDP2 holds (private: its communication context, one for the model)
    comm_ctx = model._get_fsdp_state()._comm_ctx
    notes.held = lambda: [s.reduce_scatter_input.untyped_storage().nbytes() for s in comm_ctx.reduce_scatter_states]
    x = torch.randn(8, 16)  # the same on both ranks: the averaged gradients are the plain model's
    loss = model(x)
    forward_events = list(notes.events)
    notes.events.clear()
    loss.backward()
    plain(x).backward()
    grads_match = all(
        torch.allclose(ours.grad.full_tensor(), theirs.grad)
        for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True)
    )
    results[rank] = (forward_events, notes.events, grads_match, notes.held_bytes)
    dist.destroy_process_group()


def test_a_block_is_gathered_where_it_is_needed_and_its_gradients_freed_once_reduced():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(backward_of_two_ranks, args=(free_port(), results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        forward_events, events, grads_match, held_bytes = results[rank]
        assert forward_events == ["gather, waited later"] * 4, forward_events
        # the last block stays gathered from its forward; FSDP2's default prefetch would gather block 2 before
        # block 3's backward, and so on: ["gather", "block 3", "gather", "block 2", "gather", "block 1", "block 0"]
        later = "gather, waited later"
        assert events == ["block 3", later, "block 2", later, "block 1", later, "block 0"], events
        assert grads_match
        # blocks 2, 1 and 0 run while the block before's reduce-scatter input is held: freed (FSDP2's own: 1088 bytes)
        assert len(held_bytes) == 3 and not any(held_bytes), held_bytes


def test_the_reduce_scatter_reduces_and_frees_its_input():
    comm = fsdp_on_cpu.ReduceScatterFreeingItsInput()
    values = torch.arange(6.0)
    flat = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    flat.copy_(values)
    out = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    comm(output_tensor=out, input_tensor=flat, group=dist.group.WORLD, op=dist.ReduceOp.SUM)
    torch.testing.assert_close(out, values)  # a world of one: its own values
    assert flat.untyped_storage().nbytes() == 0


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("hands_back", [False, True])
def test_a_rank_without_room_hands_the_heap_s_free_pages_back_once_reduced(hands_back):
    """128 MiB of small tensors (each from glibc's heap, below its mapping threshold) freed below one still held, as
    backward frees a layer's activations below what it allocates next: the heap keeps those pages resident, unless
    the reduce-scatter of a rank without room hands them back."""
    freed = [torch.ones(2**14) for _ in range(2048)]  # 64 KiB each
    held = torch.ones(2**14)  # above them in the heap: glibc trims only the heap's top by itself
    del freed
    before = resident_bytes()
    comm = fsdp_on_cpu.ReduceScatterFreeingItsInput(then_hand_back_freed_heap=hands_back)
    flat, out = torch.ones(6), torch.empty(6)
    comm(output_tensor=out, input_tensor=flat, group=dist.group.WORLD, op=dist.ReduceOp.SUM)
    handed_back = before - resident_bytes()
    assert (handed_back > 64 * 2**20) if hands_back else (handed_back < 16 * 2**20), handed_back / 2**20
    assert held.sum() == 2**14


def test_a_rank_hands_freed_pages_back_only_where_its_state_takes_more_than_half_its_memory(monkeypatch):
    """The trainer's FSDP2 on the CPU: a 1B-parameter GPT's state on 4 ranks (16 bytes a parameter / 4: 3.75 GiB, and
    the root and three blocks of width 2048 gathered: 0.56) against a rank's share of the node's memory, or of its
    container's limit. Nothing is built: the decision comes before the model."""
    from distsetup.training import memory
    from distsetup.training.model import build as models

    cfg = load_run_config(
        None, ["distributed.backend=fsdp", "model.n_embd=2048", "model.n_head=16", "model.n_layer=20"]
    )
    world = World(rank=0, local_rank=0, size=4, local_size=4)
    decided = {}
    for rank_memory in (16 * 2**30, 8 * 2**30):  # half of 16 GiB holds 4.3 GiB of state, half of 8 does not
        monkeypatch.setattr(memory, "device_memory_per_rank", lambda device, local, m=rank_memory: m)
        backend = FSDPBackend(cfg, world, torch.device("cpu"))
        backend.fit_to_the_model(models.describe(cfg.model).parameters)
        decided[rank_memory] = (backend.hands_back_freed_heap, backend.notes)
    assert decided[16 * 2**30] == (False, [])
    hands_back, notes = decided[8 * 2**30]
    assert hands_back and len(notes) == 1 and "4.3 GiB of training state in 8.0 GiB a rank" in notes[0], notes


def test_a_hugging_face_model_s_root_counts_in_the_decision(tmp_path, monkeypatch):
    """A Llama of 20 blocks of width 2048 and a vocabulary of 128000 (1.53B parameters, 0.52B of them in the root
    unit: embeddings and head, kept gathered) on 4 ranks of 16 GiB: its state, 5.7 GiB sharded and 2.5 gathered
    (the root, and three blocks), takes more than half. Counting three blocks alone (0.56 GiB), as when its config's
    num_hidden_layers was not read, it would keep the pages."""
    from distsetup.training import memory

    h, layers, vocab = 2048, 20, 128_000
    folder = tmp_path / "llama"
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers, "vocab_size": vocab}
    (folder / "config.json").write_text(json.dumps(config))
    cfg = load_run_config(None, ["distributed.backend=fsdp", "model.type=hf", f"model.hf_path={folder}"])
    monkeypatch.setattr(memory, "device_memory_per_rank", lambda device, local: 16 * 2**30)
    backend = FSDPBackend(cfg, World(rank=0, local_rank=0, size=4, local_size=4), torch.device("cpu"))
    block, root = 12 * h * h + 13 * h, 2 * vocab * h + h
    backend.fit_to_the_model(layers * block + root)
    assert backend.hands_back_freed_heap
    assert "8.2 GiB of training state in 16.0 GiB a rank" in backend.notes[0], backend.notes


@pytest.mark.parametrize("decided", [False, True])
def test_the_layers_reduce_scatter_as_decided(decided):
    """What fit_to_the_model decided reaches every unit's reduce-scatter (FSDP2's custom comm, read from its private
    state), in a world of one."""
    cfg = load_run_config(None, ["distributed.backend=fsdp"])
    backend = FSDPBackend(cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
    backend.hands_back_freed_heap = decided
    model = Stack(Notes())
    backend.wrap(ModelParts(model, list(model.blocks), []), cfg.training.max_steps)
    for unit in [*model.blocks, model]:
        comm = unit._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
        assert isinstance(comm, fsdp_on_cpu.ReduceScatterFreeingItsInput) and comm.then_hand_back_freed_heap is decided

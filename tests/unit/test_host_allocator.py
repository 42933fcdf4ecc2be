"""Where the trainer's CPU tensors come from (training/host_allocator.py): with the threshold a rank whose backend
gathers weights sets once its model is known, a step's largest activation stays in glibc's heap and a larger
gathered weight is mapped apart, as glibc's own counters (mallinfo2's bytes in mappings) say, with torch's huge-page
alignment on as the trainer has it. mallopt is the process's: the cases run in a process of their own."""

import json
import subprocess
import sys

import torch.nn as nn

from distsetup.planning.loss_slices import slice_width
from distsetup.training.host_allocator import MAPPED_APART_BYTES, MOST_MAPPED_APART_BYTES, mapped_apart_from
from distsetup.training.loss.sliced import as_loss_head
from distsetup.training.model_setup import largest_activation_bytes

MAPPED = """
import ctypes, json, os, sys
os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # the trainer's (ask_for_huge_pages)
import torch
from distsetup.training.host_allocator import map_large_tensors_apart

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
mapped = []
for threshold, sizes in json.loads(sys.argv[1]):
    map_large_tensors_apart(threshold)
    mapped.append({})
    for size in sizes:
        before = libc.mallinfo2().hblkhd
        tensor = torch.empty(size // 4)
        mapped[-1][size] = libc.mallinfo2().hblkhd - before >= size
        del tensor
print(json.dumps(mapped))
"""


def mapped_apart(*cases: tuple[int, list[int]]) -> list[dict[int, bool]]:
    """For each (threshold, sizes), in turn in one process: whether a CPU tensor of each size (bytes) is mapped
    apart under that threshold."""
    argv = [sys.executable, "-c", MAPPED, json.dumps(cases)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return [{int(size): mapped for size, mapped in case.items()} for case in json.loads(result.stdout)]


def test_a_steps_largest_activation_stays_in_the_heap_and_a_larger_gathered_weight_is_mapped_apart():
    activation = 4 << 20  # the peers' Llama: 8 x 128 tokens x its MLP's 1024, in fp32
    threshold = mapped_apart_from(activation)
    weight = threshold + (1 << 20)
    before, now = mapped_apart((4 << 20, [activation, weight]), (threshold, [activation, weight]))
    # with 4 MiB, as before, the activation was faulted in afresh at each of its allocations
    assert before == {activation: True, weight: True}
    assert now == {activation: False, weight: True}


def test_the_threshold_is_never_below_2_mib_nor_above_glibcs_highest():
    assert mapped_apart_from(0) == MAPPED_APART_BYTES == 2 << 20
    # the benchmark's block at 8 processes: activations of 852 KiB kept, its sharded gradients of 4.15 MB not
    assert (852 << 10) < mapped_apart_from(852 << 10) < 4_150_000
    assert mapped_apart_from(1 << 30) == MOST_MAPPED_APART_BYTES


def test_the_largest_activation_is_the_widest_linear_output_and_a_sliced_heads_slice():
    vocab, tokens = 50000, 8 * 128
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, vocab))
    assert largest_activation_bytes(model, tokens) == 4 * tokens * vocab
    as_loss_head(model[2])
    assert slice_width(vocab) < vocab
    assert largest_activation_bytes(model, tokens) == 4 * tokens * slice_width(vocab)
    assert largest_activation_bytes(model, 0) == 0  # a python data.builder's samples: size unknown

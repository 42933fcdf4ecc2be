"""How the trainer's process asks for host memory (glibc's, and torch's CPU allocator's): large CPU tensors in
transparent huge pages; where the backend gathers weights, glibc's large allocations mapped apart; the heap's free
pages handed back, on a CPU rank once after set-up (training/trainer.py) and on an FSDP2 CPU rank without room after
each reduce-scatter (backends/fsdp_on_cpu.py). Imports no torch: the huge pages are asked for before torch is."""

import ctypes
import functools
import os
from collections.abc import Callable

M_MMAP_THRESHOLD, MOST_MAPPED_APART_BYTES = -3, 32 << 20  # glibc's mallopt option; its own highest threshold
HUGE_PAGE_BYTES = 2 << 20  # torch aligns a CPU tensor of this size or more to a huge page (ask_for_huge_pages)
# the size from which allocations are mapped apart before a step's activations are known: mapped_apart_from(0), so
# that a block's sharded gradients of a few MiB leave the heap too (docs/benchmarks.md)
MAPPED_APART_BYTES = HUGE_PAGE_BYTES


def ask_for_huge_pages() -> None:
    """Large CPU tensors in transparent huge pages, unless THP_MEM_ALLOC_ENABLE is set already. glibc maps each large
    tensor fresh from the kernel and unmaps it when freed, so a CPU run faults in its 4 KiB pages every step, which
    costs more than the arithmetic on the logits (docs/benchmarks.md). torch reads the variable once, at its first
    allocation: it must be set before torch is imported."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # another C library
        return None


def mapped_apart_from(largest_activation: int) -> int:
    """The size from which a rank whose backend gathers weights maps allocations apart, once its step's largest
    activation (bytes) is known: just above that activation (a huge page above: torch's alignment takes up to one
    more from glibc, so at least 2 MiB), at most glibc's own highest threshold, 32 MiB. Activations, which come and go
    several times a step, stay in the heap rather than being faulted in afresh each time; larger tensors, a block's
    gathered weights and its sharded gradients, do not. With a floor of 4 MiB a 200M GPT's sharded gradients at 8
    processes (4.15 MB a block) took heap pages amid the activations' each step, and FSDP2's other ranks peaked at
    0.91 of the model over 5 steps against 0.82 over 2; mapped apart, 0.82 over both (docs/benchmarks.md). Where a
    step's activations outgrow its gathered weights, the weights stay in the heap too: the activations of every
    layer, held for backward, then outweigh them anyway."""
    return min(MOST_MAPPED_APART_BYTES, largest_activation + HUGE_PAGE_BYTES)


def map_large_tensors_apart(from_bytes: int = MAPPED_APART_BYTES) -> None:
    """Each allocation of `from_bytes` (2 MiB, or mapped_apart_from's) or more in a mapping of its own, returned to
    the system as soon as it is freed. glibc's own threshold rises with each large block freed, up to 32 MiB, after
    which a layer's gathered weights and gradients come from its heap, which keeps the pages they leave: a rank's
    resident memory grows past what it holds (under FSDP2, by a third of a 200M model at 2 processes; at 8 processes
    ZeRO-3's others peaked at 1.56 of it with glibc's own threshold, FSDP2's at 1.03: docs/benchmarks.md). Smaller
    allocations stay in the heap: mapping those too (glibc's starting threshold, 128 KiB) held a little less but
    faulted in every activation, and a small model's CPU step ran at 0.6 of the speed. Only for a backend that
    gathers weights (distsetup/train.py before set-up, 2 MiB; training/trainer.py once the model is known): where
    each rank holds its weights whole, nothing of a layer's size comes and goes each step. mallopt(3); another C
    library is left as is."""
    if (libc := _libc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, from_bytes)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    libc = _libc()
    return getattr(libc, "malloc_trim", None) if libc is not None else None


def hand_back_freed_heap() -> None:
    """glibc's malloc_trim(0): every free page of the heap back to the system, not only its top. Another C library:
    nothing."""
    if (trim := _malloc_trim()) is not None:
        trim(0)

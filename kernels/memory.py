"""Large, long-lived CPU buffers (packed weights, the KV pool) on transparent huge pages.

A decode step streams every weight once (~95 MB for SmolLM2 in `auto`) and, at large
batches, every sequence's keys and values: on 4 KB pages that is a TLB miss every 4 KB. Linux
gives a mapping 2 MB pages when asked (`madvise(MADV_HUGEPAGE)`, the default policy of most
distributions being `madvise`) for the pages first touched after the call, so `empty` asks
before anything is written. Where the kernel says no (THP off, not Linux), the buffer is an
ordinary one: nothing else changes.

The C heap's policy lives here too: `trim_heap` once the weights are packed (what packing
unpacked goes back to the system), then `keep_heap` (a step's freed buffers stay for the next
step instead of coming back as fresh, faulted-in pages).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE  # smaller buffers would gain at most one huge page
_MADV_HUGEPAGE = 14
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
STEP_HEAP_BYTES = 256 << 20  # the largest block keep_heap serves from the heap
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`); False where
    there is none. Weights are packed for their kernels at their first use, and the unpacked
    integers freed then stay in the process's resident set otherwise: 0.26 GB at the 1B
    shape on an AVX512-VNNI CPU (docs/BENCHMARKS.md)."""
    trim = getattr(_libc, "malloc_trim", None) if _libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True


def keep_heap(max_block: int = STEP_HEAP_BYTES) -> bool:
    """Serve C-heap blocks up to `max_block` bytes from the heap and keep freed ones there
    (glibc's `mallopt`: the mmap threshold at `max_block`, the trim threshold at twice it);
    False where there is no such call. A step's activations are freed and allocated again
    every layer (the 1B shape's gate and up rows of a 256-token prompt step are 17.8 MB);
    left to glibc's own thresholds they come back as fresh pages, which the system faults in
    and zeroes one 4 KB page at a time: 3.8 % of a served prompt phase's samples, ~120 k page
    faults per 2,100 prompt tokens (docs/BENCHMARKS.md, "Twenty-first session"). Kept, the
    heap holds the largest step's working set between steps (the served 1B shape's resident
    set after a concurrency-16 run: the same). Call it after the weights are packed and
    `trim_heap` has run."""
    mallopt = getattr(_libc, "mallopt", None) if _libc is not None else None
    if mallopt is None:
        return False
    return (mallopt(_M_MMAP_THRESHOLD, max_block) == 1
            and mallopt(_M_TRIM_THRESHOLD, 2 * max_block) == 1)


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` whose whole 2 MB pages are advised huge."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge(t)
    return t


def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed buffer (the KV pool) whose pages are not touched here: an anonymous mapping
    of its own, whose pages the system zeroes when each is first written, so the resident set
    grows with what is written (the KV blocks used) instead of holding the whole buffer from
    the start, as `torch.zeros` (which writes every zero) does. calloc would not do: it may
    hand back freed heap memory, which it then zeroes by writing. Starts on a 2 MB boundary,
    huge-page advised like `empty`; unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (shared ones are shmem: no THP)
    flat = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE, flags=private), dtype=torch.uint8)
    start = -flat.data_ptr() % HUGE_PAGE
    t = flat[start:start + nbytes].view(dtype).view(shape)
    advise_huge(t)
    return t


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for huge pages over the whole 2 MB pages inside t's storage; True if granted.
    Only pages not yet touched are affected: call it before writing."""
    nbytes = t.numel() * t.element_size()
    if _libc is None or nbytes < MIN_BYTES or t.device.type != "cpu":
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                         _MADV_HUGEPAGE) == 0

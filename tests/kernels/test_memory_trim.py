"""kernels.memory.trim_heap: freed C-heap pages go back to the system (glibc), so the integers a
weight's packing unpacked do not stay in the worker's resident set."""
from __future__ import annotations

import ctypes
import sys

import pytest

from duplex.kernels import memory


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="glibc only")
def test_trim_returns_freed_heap_pages():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # blocks below the mmap threshold, each held apart from the next by a small live one: the
    # freed blocks cannot merge into the heap's top, so only a trim gives their pages back
    blocks, spacers = [], []
    for _ in range(1600):  # 100 MB
        blocks.append(libc.malloc(64 << 10))
        spacers.append(libc.malloc(16))
        ctypes.memset(blocks[-1], 1, 64 << 10)
    for b in blocks:
        libc.free(b)
    before = _rss_kb()
    assert memory.trim_heap()
    after = _rss_kb()
    for s in spacers:
        libc.free(s)
    assert before - after > 50 << 10, (before, after)  # at least 50 of the 100 MB came back

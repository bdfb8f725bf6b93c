"""kernels.memory.trim_heap: freed C-heap pages go back to the system (glibc), so the integers a
weight's packing unpacked do not stay in the worker's resident set. Run in a fresh interpreter:
what an earlier test left in the heap (or already trimmed) would blur the figures."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

PROGRAM = r"""
import ctypes, json
from duplex.kernels import memory

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

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
before = rss_kb()
trimmed = memory.trim_heap()
print(json.dumps({"trimmed": trimmed, "before": before, "after": rss_kb()}))
"""


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="glibc only")
def test_trim_returns_freed_heap_pages():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["trimmed"]
    assert got["before"] - got["after"] > 50 << 10, got  # at least 50 of the 100 MB came back

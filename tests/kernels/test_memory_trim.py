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


KEEP_PROGRAM = r"""
import ctypes, json, resource, sys
from duplex.kernels import memory

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
kept = memory.keep_heap() if sys.argv[1] == "keep" else None
SIZE, ROUNDS = 40 << 20, 20  # above glibc's own largest mmap threshold (32 MB)
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(ROUNDS):  # a step's buffer: allocated, written, freed
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
print(json.dumps({"kept": kept, "faults": faults, "pages": SIZE // 4096, "rounds": ROUNDS}))
"""


def keep_run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", KEEP_PROGRAM, mode], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(ctypes.CDLL(None), "mallopt"),
                    reason="glibc only")
def test_keep_heap_reuses_freed_step_buffers():
    """After keep_heap a freed 40 MB buffer is reused by the next allocation: its pages are
    faulted in once, not once per round as with glibc's own thresholds (each round a fresh
    mapping the system zeroes page by page)."""
    plain, kept = keep_run("plain"), keep_run("keep")
    assert kept["kept"] is True
    assert plain["faults"] > plain["rounds"] // 2 * plain["pages"], plain  # the control
    assert kept["faults"] < 2 * kept["pages"], kept

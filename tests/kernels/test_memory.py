"""duplex.kernels.memory: buffers advised onto transparent huge pages hold what is written to them,
small ones are left alone, the advice is accepted where the kernel offers THP, and a zeroed
buffer (the KV pool) becomes resident only where it is written."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from duplex.kernels import memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_offered() -> bool:
    return THP.is_file() and "[never]" not in THP.read_text()


@pytest.mark.skipif(not thp_offered(), reason="no transparent huge pages here")
def test_large_buffers_are_advised_and_hold_their_data():
    t = memory.empty((3, 1 << 20), torch.float32)  # 12 MB
    assert memory.advise_huge(t)  # again: still accepted
    t.copy_(torch.arange(3 << 20, dtype=torch.float32).view(3, -1))
    assert t[2, -1].item() == (3 << 20) - 1 and t.is_contiguous()


def test_small_buffers_are_left_alone():
    t = memory.empty((1024,), torch.float32)
    assert not memory.advise_huge(t) and t.shape == (1024,)


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e6


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="no /proc here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_zeros_hold_only_what_is_written(dtype):
    """A 256 MB pool: all zeros, 2 MB-aligned, and the process holds (about) the pages written
    to, not the whole buffer (torch.zeros would write every byte: 256 MB resident)."""
    before = resident_mb()
    row = memory.HUGE_PAGE // dtype.itemsize
    pool = memory.zeros((64, row), dtype)  # 64 rows of 2 MB
    assert pool.shape[0] == 64 and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % memory.HUGE_PAGE == 0
    assert pool.numel() * pool.element_size() == 64 << 21
    assert resident_mb() - before < 32
    assert not pool[::7].any()  # reading maps the zero page: nothing becomes resident
    assert resident_mb() - before < 32
    pool[3].fill_(1)
    pool[40, 5] = 2
    assert resident_mb() - before < 32  # two of the 64 2 MB rows written
    assert pool[3].eq(1).all() and pool[40, 5].item() == 2
    assert int(pool.count_nonzero()) == row + 1
    pool.fill_(0)  # every page written
    assert resident_mb() - before > 100

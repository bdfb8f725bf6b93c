"""duplex.kernels.memory: buffers advised onto transparent huge pages hold what is written to them,
small ones are left alone, and the advice is accepted where the kernel offers THP."""
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

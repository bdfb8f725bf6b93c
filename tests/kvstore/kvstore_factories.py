"""Factories for the kvstore tests: a settable clock, entries, keys."""
from __future__ import annotations

import hashlib

from duplex.kvstore import retention
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.keys import block_keys, namespace

T0 = 1_700_000_000.0  # a fixed "now" for every test clock
DAY = retention.DAY_S
NS = namespace("test-model", "float16", 4, "L2-K-V")


class FakeClock:
    """Injectable clock; tests jump it forward."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def payload_of(seed: int, nbytes: int) -> bytes:
    """Deterministic, seed-specific bytes (so a wrong block is never equal by accident)."""
    return hashlib.shake_128(seed.to_bytes(8, "little")).digest(nbytes)


def make_entry(seed: int = 0, nbytes: int = 256, *, cls: str = retention.CHAT,
               now: float = T0, dtype: str = "float16") -> BlockEntry:
    return BlockEntry(payload_of(seed, nbytes), dtype, (2, nbytes // 4, 2), 16,
                      retention.expiry(cls, now))


def make_keys(num_blocks: int, ns: bytes | None = None, salt: int = 0) -> list[bytes]:
    ns = NS if ns is None else ns
    return block_keys(ns, [salt * 1000 + i for i in range(num_blocks * 4)], 4)

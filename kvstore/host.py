"""`HostTier`: KV blocks in host RAM, bounded in bytes, evicted least-recently-used first.

Owns the host-RAM copy of blocks and its byte accounting. Not thread-safe: one event loop
(or one thread) drives it. Expired entries are never returned; they are dropped when met.
Evicted (unexpired) entries are handed to `on_evict` — the store uses it to spill to disk.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from duplex.kvstore.entry import BlockEntry

__all__ = ["BlockEntry", "HostTier"]

_COUNTERS = ("hits", "misses", "puts", "rejected", "evictions", "expirations")


class HostTier:
    def __init__(self, capacity_bytes: int, *, clock: Callable[[], float] = time.time,
                 on_evict: Callable[[bytes, BlockEntry], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._on_evict = on_evict
        self._entries: OrderedDict[bytes, BlockEntry] = OrderedDict()  # oldest access first
        self._bytes = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def put(self, key: bytes, entry: BlockEntry) -> bool:
        """Store (or replace) `key`, evicting LRU entries to fit. False if it cannot fit or
        is already expired."""
        if entry.nbytes > self.capacity_bytes or entry.is_expired(self._clock()):
            self._counts["rejected"] += 1
            return False
        self._remove(key)
        self.evict(entry.nbytes)
        self._entries[key] = entry
        self._bytes += entry.nbytes
        self._counts["puts"] += 1
        return True

    def get(self, key: bytes) -> BlockEntry | None:
        """The entry, marked most recently used; None if absent or expired (then dropped)."""
        entry = self._live(key)
        if entry is None:
            self._counts["misses"] += 1
            return None
        self._entries.move_to_end(key)
        self._counts["hits"] += 1
        return entry

    def contains(self, key: bytes) -> bool:
        """Present and unexpired; does not touch the LRU order."""
        entry = self._entries.get(key)
        return entry is not None and not entry.is_expired(self._clock())

    def pop(self, key: bytes) -> BlockEntry | None:
        """Remove and return the entry (None if absent or expired)."""
        entry = self._live(key)
        self._remove(key)
        return entry

    def evict(self, num_bytes: int) -> int:
        """Evict LRU entries until `num_bytes` are free; returns how many were evicted."""
        num_evicted = 0
        while self._entries and self.capacity_bytes - self._bytes < num_bytes:
            key, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            if entry.is_expired(self._clock()):
                self._counts["expirations"] += 1
                continue
            self._counts["evictions"] += 1
            num_evicted += 1
            if self._on_evict is not None:
                self._on_evict(key, entry)
        return num_evicted

    def sweep(self) -> int:
        """Drop every expired entry; returns how many."""
        now = self._clock()
        expired = [k for k, e in self._entries.items() if e.is_expired(now)]
        for key in expired:
            self._remove(key)
        self._counts["expirations"] += len(expired)
        return len(expired)

    def stats(self) -> dict[str, int]:
        return dict(self._counts, bytes=self._bytes, entries=len(self._entries),
                    capacity_bytes=self.capacity_bytes)

    def _live(self, key: bytes) -> BlockEntry | None:
        """The entry if present and unexpired; an expired one is dropped and counted."""
        entry = self._entries.get(key)
        if entry is not None and entry.is_expired(self._clock()):
            self._remove(key)
            self._counts["expirations"] += 1
            return None
        return entry

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

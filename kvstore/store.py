"""`KVStore`: the facade the engine talks to — host RAM, then disk, then the shared store.

Owns the policy between the tiers: new blocks go to host RAM; blocks the host evicts spill to
disk (once: the disk tier deduplicates by key); disk and shared hits are promoted back into
host RAM. The shared tier (fleet-wide, `kvstore.shared`) is written behind at publish and
read a whole prefix chain at a time; it has no local index, so `lookup` never names it.
It owns no bytes itself. Counters are flat, ready for Prometheus.

The package (`duplex.kvstore`): the host-RAM and disk tiers of the KV cache, their TTL and integrity.

Stores opaque bytes (no torch). Imports nothing else of Duplex.

  keys       the content address of a block (one versioned function for every cache)
  retention  chat / agent retention classes and expiry
  entry      BlockEntry: one block's payload and small header
  host       HostTier: RAM, byte-bounded LRU
  blockfile  the on-disk format of one block file, blocking file operations
  disk       DiskTier: files, write-behind queue, LRU cap, TTL sweep, restart index
  store      KVStore: host in front of disk (spill, promote, lookup, flat stats)
  errors     KVStoreError
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from duplex.kvstore.disk import DiskTier
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.host import HostTier
from duplex.kvstore.shared import SharedTier

HOST, DISK, SHARED = "host", "disk", "shared"


class KVStore:
    def __init__(self, host_capacity_bytes: int = 0, disk: DiskTier | None = None, *,
                 clock: Callable[[], float] = time.time, promote: bool = True,
                 shared: SharedTier | None = None) -> None:
        """host_capacity_bytes = 0: no host tier. `disk` and `shared` are started and closed
        by the store."""
        self.host = (HostTier(host_capacity_bytes, clock=clock, on_evict=self._spill)
                     if host_capacity_bytes > 0 else None)
        self.disk = disk
        self.shared = shared
        self.promote = promote
        self._counts = dict.fromkeys(("hits_host", "hits_disk", "hits_shared", "misses",
                                      "spills"), 0)

    async def start(self) -> None:
        if self.disk is not None:
            await self.disk.start()
        if self.shared is not None:
            await self.shared.start()

    async def close(self) -> None:
        if self.disk is not None:
            await self.disk.close()
        if self.shared is not None:
            await self.shared.close()

    async def flush(self) -> None:
        """Wait for queued disk and shared-store writes and removals."""
        if self.disk is not None:
            await self.disk.flush()
        if self.shared is not None:
            await self.shared.flush()

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier of each leading present key ("host" or "disk"), stopping at the first miss.
        Index only: a later `get_many` may still miss (expiry learnt, file found damaged)."""
        tiers = []
        for key in keys:
            tier = self._tier_of(key)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    async def get_many(self, keys: Sequence[bytes]) -> list[BlockEntry | None]:
        """Entries for `keys`, None where absent; disk reads run concurrently."""
        entries = [self._get_host(key) for key in keys]
        missing = [i for i, entry in enumerate(entries) if entry is None]
        if self.disk is not None and missing:
            found = await asyncio.gather(*(self.disk.get(keys[i]) for i in missing))
            for i, entry in zip(missing, found):
                entries[i] = entry
                self._on_disk_read(keys[i], entry)
        self._counts["misses"] += sum(entry is None for entry in entries)
        return entries

    async def get_shared(self, keys: Sequence[bytes]) -> list[BlockEntry | None]:
        """The leading blocks of `keys` the shared store holds (None from the first miss),
        each promoted into host RAM."""
        if self.shared is None:
            return [None] * len(keys)
        entries = await self.shared.get_chain(keys)
        for key, entry in zip(keys, entries):
            if entry is not None:
                self._counts["hits_shared"] += 1
                if self.promote and self.host is not None:
                    self.host.put(key, entry)
        return entries

    def put_behind(self, key: bytes, entry: BlockEntry) -> None:
        """A freshly computed block: queue it for disk and the shared store (each
        deduplicates by key)."""
        if self.disk is not None:
            self.disk.put(key, entry)
        if self.shared is not None:
            self.shared.put(key, entry)

    def put(self, key: bytes, entry: BlockEntry, *, write_through: bool = False) -> None:
        """Store in host RAM; straight to disk as well with `write_through`, or when there
        is no host tier or the host cannot take it."""
        in_host = self.host is not None and self.host.put(key, entry)
        if self.disk is not None and (write_through or not in_host):
            self.disk.put(key, entry)

    def stats(self) -> dict[str, float]:
        host = self.host.stats() if self.host is not None else {}
        disk = self.disk.stats() if self.disk is not None else {}
        flat = dict(self._counts)
        flat.update(bytes_host=host.get("bytes", 0), bytes_disk=disk.get("bytes", 0),
                    entries_host=host.get("entries", 0), entries_disk=disk.get("entries", 0),
                    evictions_host=host.get("evictions", 0),
                    evictions_disk=disk.get("evictions", 0),
                    expirations=host.get("expirations", 0) + disk.get("expirations", 0),
                    corrupt_dropped=disk.get("corrupt_dropped", 0),
                    write_errors=disk.get("write_errors", 0))
        flat.update({f"disk_{name}": value for name, value in disk.items()
                     if f"{name}_disk" not in flat and name not in flat})
        if self.shared is not None:
            flat.update({f"shared_{name}": value for name, value in self.shared.stats().items()})
        return {name: float(value) for name, value in flat.items()}

    def _tier_of(self, key: bytes) -> str | None:
        if self.host is not None and self.host.contains(key):
            return HOST
        if self.disk is not None and self.disk.contains(key):
            return DISK
        return None

    def _get_host(self, key: bytes) -> BlockEntry | None:
        entry = self.host.get(key) if self.host is not None else None
        if entry is not None:
            self._counts["hits_host"] += 1
        return entry

    def _on_disk_read(self, key: bytes, entry: BlockEntry | None) -> None:
        if entry is None:
            return
        self._counts["hits_disk"] += 1
        if self.promote and self.host is not None:
            self.host.put(key, entry)

    def _spill(self, key: bytes, entry: BlockEntry) -> None:
        """HostTier eviction hook: keep the block on disk (no-op if already there)."""
        if self.disk is not None and self.disk.put(key, entry):
            self._counts["spills"] += 1

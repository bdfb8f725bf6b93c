"""The engine side of the KV cache hierarchy: device pool <-> host RAM <-> disk <-> shared.

Owns three things:
  KVTiers    a `kvstore.KVStore` (host RAM, disk, the fleet-shared store) on its own event loop
             in a daemon thread, behind thread-safe synchronous methods: the core steps in an
             executor thread and the offline `LLM` has no loop at all.
  BlockCodec the copy of one device block (every layer, K and V) to and from a BlockEntry.
  TierLink   what moves between the device pool and the tiers, and the per-request disk
             reads in flight. The KV manager is its only caller.

    down:  device --evict------------> host RAM --spill--> disk
           device --publish--write-behind---------------> disk     (a restart loses nothing)
           device --publish--write-behind---------------> shared   (every worker sees it)
    up:    device <--load at scheduling-- host RAM <--prefetch at admission-- disk
                                                  <--prefetch at admission-- shared (the
                                                     part of the prefix no local tier has)

Nothing here blocks a step on disk: writes are queued, reads start when a request arrives
and the scheduler runs other requests until they land (or a short timeout passes). Nor on
the device: a spill's copy to the host is queued on the step's stream and waited for by
the tiers' thread (BlockCodec.save_many_later, KVTiers.put_copied / write_behind).
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import logging
import math
import os
import threading
import time
import warnings
from typing import Awaitable, Callable, NamedTuple, Sequence

import msgspec
import torch

from duplex.engine.config import EngineConfig
from duplex.engine.platform import HostCopy, Platform, cpu
from duplex.engine.stats import KVStats, KVTierStats, SharedTierStats
from duplex.kernels.kv_store import kv_encoding
from duplex.kvstore.disk import DiskConfig, DiskTier
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.errors import KVStoreError
from duplex.kvstore.retention import RetentionPolicy
from duplex.kvstore.shared import open_shared
from duplex.kvstore.store import DISK, HOST, SHARED, KVStore

DEVICE = "device"
TIERS = (DEVICE, HOST, DISK, SHARED)
# How long a request waits for its disk reads before computing what has not arrived. Reads
# of a 2,000-token prefix take ~0.1-0.7 s on the CPU boxes; computing it takes a minute.
LOAD_TIMEOUT_S = 2.0
_CLOSE_TIMEOUT_S = 60.0
log = logging.getLogger("duplex.kv_tiers")


def private_kv_dir(config: EngineConfig, worker_id: str) -> EngineConfig:
    """`--kv-dir /ssd/kv/{worker}`: each worker its own private disk tier (a directory
    belongs to one process); the shared tier is `--kv-remote`."""
    if not config.cache.kv_dir or "{worker}" not in config.cache.kv_dir:
        return config
    return config.replace(kv_dir=config.cache.kv_dir.replace("{worker}", worker_id))


class KVTiers:
    """A KVStore on a private event loop thread; every method may be called from any thread.

    `clock` (seconds) stamps expiries and decides what has expired; tests replace it to
    travel in time. `put`, `put_copied` and `write_behind` never block (the last two take
    blocks whose copy off the device may still be in flight and wait for it on a thread of
    the loop; `flush` and `close` wait for those too); the rest wait for one loop hop.
    """

    def __init__(self, host_bytes: int, disk: DiskConfig | None,
                 policy: RetentionPolicy = RetentionPolicy(), *,
                 clock: Callable[[], float] = time.time,
                 shared: SharedSpec | None = None) -> None:
        self.clock = clock
        self.policy = policy
        self.has_host = host_bytes > 0
        self.has_disk = disk is not None
        self.has_shared = shared is not None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-tiers",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        self._copies = _CopyWaits(self._loop)  # writes waiting for their device copies
        try:
            self._store = self._call(self._open(host_bytes, disk, shared))
        except BaseException:
            self._stop_loop()
            raise
        atexit.register(self.close)  # flush queued writes even if nobody calls close()

    @classmethod
    def from_config(cls, config: EngineConfig, namespace: bytes) -> KVTiers | None:
        """Tiers of an EngineConfig (None when every tier is off). `namespace` is the
        model-level key namespace (no tenant salt) that guards disk files and shared values."""
        disk = None
        if config.cache.kv_dir:
            disk = DiskConfig(os.path.expanduser(config.cache.kv_dir), namespace,
                              config.cache.kv_disk_bytes)
        shared = SharedSpec(config.cache.kv_remote, namespace, config.cache.kv_remote_bytes) \
            if config.cache.kv_remote else None
        if disk is None and shared is None and config.cache.kv_host_bytes <= 0:
            return None
        policy = RetentionPolicy(config.cache.chat_ttl_s, config.cache.agent_ttl_s)
        try:
            return cls(config.cache.kv_host_bytes, disk, policy, shared=shared)
        except KVStoreError as exc:
            raise KVStoreError(f"--kv-dir {config.cache.kv_dir!r} cannot be used: {exc}") from exc

    async def _open(self, host_bytes: int, disk: DiskConfig | None,
                    shared: SharedSpec | None) -> KVStore:
        now = lambda: self.clock()  # noqa: E731 - late-bound, so a replaced clock counts
        remote = None if shared is None else open_shared(
            shared.url, shared.namespace, shared.capacity_bytes, clock=now)
        store = KVStore(host_bytes, DiskTier(disk, clock=now) if disk else None, clock=now,
                        shared=remote)
        await store.start()
        return store

    # ------------------------------------------------------------------ writes (no waiting)
    def put(self, key: bytes, entry: BlockEntry) -> None:
        """Keep `entry` in host RAM (it spills to disk when RAM evicts it; straight to disk
        when there is no host tier). The tiers own `entry.payload` from now on. Dropped
        once closed."""
        if not self._closed:
            self._loop.call_soon_threadsafe(self._store.put, key, entry)

    def put_copied(self, keys: Sequence[bytes], copies: BlockCopies) -> None:
        """`put` of each key's entry once `copies` are done: at once when they are, else
        waited for on a thread of the loop, never the caller's (until then those keys
        miss). Dropped once closed."""
        if not self._closed:
            self._loop.call_soon_threadsafe(self._copies.store, list(keys), copies,
                                            self._store.put)

    def write_behind(self, keys: Sequence[bytes], copies: BlockCopies) -> None:
        """Queue each key's entry for the disk tier and the shared store (deduplicated by
        key), once `copies` are done (as put_copied)."""
        if (self.has_disk or self.has_shared) and not self._closed:
            self._loop.call_soon_threadsafe(self._copies.store, list(keys), copies,
                                            self._store.put_behind)

    @property
    def shared_is_on(self) -> bool:
        """A shared tier exists and its breaker is closed (a plain read across threads: a
        stale answer costs one wasted or one skipped read, never a wrong hit)."""
        return self.has_shared and self._store.shared.is_on

    def expiry(self, retention: str) -> float:
        """Absolute expiry of a block stored now by a request of class `retention`."""
        return self.policy.expiry(retention, self.clock())

    # ------------------------------------------------------------------ reads
    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier ("host" / "disk") of each leading present key, stopping at the first miss."""
        return self._call_sync(self._store.lookup, list(keys))

    def prefetch(self, keys: Sequence[bytes],
                 landed: dict[bytes, BlockEntry] | None = None,
                 shared_keys: Sequence[bytes] = ()) -> concurrent.futures.Future:
        """Start reading `keys` from disk (concurrently, each promoted into host RAM as it
        lands) and the chain `shared_keys` from the shared store (one round trip); the
        future gives the entries of keys + shared_keys, None where missing. Each entry found
        is also put in `landed` the moment it is read, so a caller that stops waiting early
        still has what arrived (with or without a host tier)."""
        return asyncio.run_coroutine_threadsafe(
            self._prefetch(list(keys), landed, list(shared_keys)), self._loop)

    async def _prefetch(self, keys: list[bytes], landed: dict[bytes, BlockEntry] | None,
                        shared_keys: list[bytes]) -> list[BlockEntry | None]:
        async def read(key: bytes) -> BlockEntry | None:
            entry, = await self._store.get_many([key])  # one key: promoted as soon as read
            if entry is not None and landed is not None:
                landed[key] = entry
            return entry

        async def read_shared() -> list[BlockEntry | None]:
            entries = await self._store.get_shared(shared_keys)
            if landed is not None:
                landed.update((k, e) for k, e in zip(shared_keys, entries) if e is not None)
            return entries
        disk, shared = await asyncio.gather(asyncio.gather(*(read(key) for key in keys)),
                                            read_shared())
        return list(disk) + list(shared)

    def get_host(self, key: bytes) -> BlockEntry | None:
        return self.get_host_many([key])[0]

    def get_host_many(self, keys: Sequence[bytes]) -> list[BlockEntry | None]:
        """Host-RAM entries of `keys` (None where absent or expired); never touches disk."""
        if not self.has_host:
            return [None] * len(keys)
        return self._call_sync(lambda: [self._store.host.get(key) for key in keys])

    def stats(self) -> dict[str, float]:
        """`KVStore.stats()`: flat counters and byte totals of both tiers."""
        return self._call_sync(self._store.stats)

    def kv_stats(self, kv: KVStats) -> KVStats:
        """kv (the device's figures) with the host, disk and shared tiers' added."""
        return store_stats(kv, self.stats())

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Wait until every disk write queued so far is on disk."""
        self._call(self._copies.then(self._store.flush), _CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """Flush queued writes, release the disk directory, stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._call(self._copies.then(self._store.close), _CLOSE_TIMEOUT_S)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _call_sync(self, fn, *args):
        async def run():
            return fn(*args)
        return self._call(run())


class BlockCodec:
    """Copies device blocks to and from BlockEntry payloads.

    One block of every layer is kv[:, :, block_id]: [num_layers, 2, block_size, kv_heads,
    row]; its payload is that view made contiguous, as raw bytes (an int8 pool's rows keep
    their scales: entries say so, `encoding`, and only a pool of that encoding takes them).
    Several blocks move as one batch on a device (`gather`): one gather kernel and one copy
    into a pinned host buffer queued on the current stream (`platform.HostCopy`), instead of
    a strided copy and a wait per block; `save_many_later` does not even wait for that copy
    (the tiers' thread does), so a spill never stalls the step thread behind the step in
    flight. On the CPU there is no transfer to save, so each block is one copy, made at
    once."""

    def __init__(self, kv: torch.Tensor, platform: Platform | None = None) -> None:
        self.kv = kv  # [num_layers, 2, num_blocks, block_size, num_kv_heads, row]
        self.platform = platform or cpu()  # only decides whether batches gather
        self.dtype = str(kv.dtype).removeprefix("torch.")
        self.encoding = kv_encoding(kv.dtype)
        self.shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
        self.block_size = kv.shape[3]
        self.nbytes = math.prod(self.shape) * kv.element_size()

    def save(self, block_id: int, expires_at: float) -> BlockEntry:
        """A private copy of the block (the entry never aliases the pool)."""
        block = self.kv[:, :, block_id].clone(memory_format=torch.contiguous_format)
        payload = block.reshape(-1).view(torch.uint8).cpu().numpy()  # .cpu(): no copy on a CPU
        return BlockEntry(payload, self.dtype, self.shape, self.block_size, expires_at,
                          self.encoding)

    def save_many(self, block_ids: Sequence[int], expires_at: Sequence[float],
                  gather: bool | None = None) -> list[BlockEntry]:
        """Private copies of several blocks. gather (default: on a device, for two blocks or
        more): one batched device-to-host copy, each entry then copied out of it so that it
        owns its bytes (the host tier budgets entries one by one)."""
        if not self._batched(len(block_ids), gather):
            return [self.save(b, e) for b, e in zip(block_ids, expires_at)]
        return self.save_many_later(block_ids, expires_at, gather=True)()

    def save_many_later(self, block_ids: Sequence[int], expires_at: Sequence[float],
                        gather: bool | None = None) -> BlockCopies:
        """save_many without waiting for the copy. gather (default: on a device) queues one
        gather and one copy to pinned memory on the current stream, after the steps queued
        so far and before any later one, so a block a later step reuses is copied first;
        without it the entries are made now."""
        if not (self.platform.is_cuda if gather is None else gather) or not block_ids:
            return BlockCopies(self.save_many(block_ids, expires_at, gather=False))
        blocks = self.kv.index_select(2, self.platform.ids_to_device(block_ids))
        copy = HostCopy(blocks.movedim(2, 0))  # [n, layers, 2, ...], not waited for
        return BlockCopies(functools.partial(self._entries, copy, list(expires_at)), copy)

    def _entries(self, copy: HostCopy, expires_at: list[float]) -> list[BlockEntry]:
        flat = copy.wait().reshape(len(expires_at), -1).view(torch.uint8).numpy()
        return [BlockEntry(flat[i].copy(), self.dtype, self.shape, self.block_size, e,
                           self.encoding) for i, e in enumerate(expires_at)]

    def fits(self, entry: BlockEntry) -> bool:
        """Whether `entry` is a block of this pool's layout (anything else is a miss)."""
        return (entry.dtype == self.dtype and entry.encoding == self.encoding
                and tuple(entry.shape) == self.shape
                and entry.nbytes == self.nbytes and entry.num_tokens == self.block_size)

    def load(self, block_id: int, entry: BlockEntry) -> None:
        assert self.fits(entry), "load only entries that fit the pool"
        self.kv[:, :, block_id].copy_(self._host_view(entry))

    def load_many(self, block_ids: Sequence[int], entries: Sequence[BlockEntry],
                  gather: bool | None = None) -> None:
        """Entries into blocks. gather (default: on a device, for two blocks or more): the
        payloads packed into one pinned host buffer, one asynchronous host-to-device copy
        and one scatter kernel."""
        assert all(self.fits(e) for e in entries), "load only entries that fit the pool"
        if not self._batched(len(block_ids), gather):
            for block_id, entry in zip(block_ids, entries):
                self.load(block_id, entry)
            return
        host = self.platform.empty_host((len(entries), *self.shape), self.kv.dtype)
        for i, entry in enumerate(entries):
            host[i].copy_(self._host_view(entry))
        blocks = self.platform.to_device(host)  # non-blocking from pinned memory
        self.kv.index_copy_(2, self.platform.ids_to_device(block_ids), blocks.movedim(0, 2))

    def _batched(self, num_blocks: int, gather: bool | None) -> bool:
        """Whether num_blocks move as one batch: gather, by default on a device; never one."""
        return num_blocks > 1 and (self.platform.is_cuda if gather is None else gather)

    def _host_view(self, entry: BlockEntry) -> torch.Tensor:
        with warnings.catch_warnings():  # read-only payloads are only read here
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(entry.payload, dtype=self.kv.dtype)
        return src.view(self.shape)


class BlockCopies:
    """Entries of blocks whose copy to the host may still be in flight
    (BlockCodec.save_many_later): `ready` says whether the copy is done, calling it waits
    for the copy (from any thread) and gives the entries."""

    def __init__(self, entries: list[BlockEntry] | Callable[[], list[BlockEntry]],
                 copy: HostCopy | None = None) -> None:
        self._entries, self._copy = entries, copy

    @property
    def ready(self) -> bool:
        return self._copy is None or self._copy.is_done()

    def __call__(self) -> list[BlockEntry]:
        return self._entries if self._copy is None else self._entries()


class _CopyWaits:
    """On the tiers' loop: writes whose entries are still being copied off the device."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tasks: set[asyncio.Task] = set()

    def store(self, keys: list[bytes], copies: BlockCopies,
              put: Callable[[bytes, BlockEntry], None]) -> None:
        """put(key, entry) for each key, at once if the copies are done (in order with
        the calls queued after this one), else once a thread has waited for them."""
        if copies.ready:
            for key, entry in zip(keys, copies()):
                put(key, entry)
            return

        async def wait_then_put():
            try:
                entries = await self._loop.run_in_executor(None, copies)
            except Exception:  # a failed copy loses these writes, never a step
                log.exception("a KV block copy to the host failed; %d blocks not stored",
                              len(keys))
                return
            for key, entry in zip(keys, entries):
                put(key, entry)
        task = self._loop.create_task(wait_then_put())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def then(self, after: Callable[[], Awaitable[None]]) -> None:
        """Wait for the writes queued so far to reach the store, then for after()."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        await after()


class SharedSpec(NamedTuple):
    url: str  # --kv-remote
    namespace: bytes  # model-level namespace the values must carry
    capacity_bytes: int  # size budget of a shared directory


class TierHit(NamedTuple):
    entry: BlockEntry
    tier: str  # "host", or "disk" / "shared" when it came up from there for this request


class _Load(NamedTuple):
    keys: list[bytes]  # blocks being read from disk or the shared store for one request
    shared_keys: frozenset[bytes]  # which of them come from the shared store
    landed: dict[bytes, BlockEntry]  # those read so far (filled by the tiers' thread)
    future: concurrent.futures.Future
    deadline: float  # time.monotonic() after which the request stops waiting


class TierLink:
    """The device pool's door to the tiers: block copies down, request prefixes up.

    Owns the expiry of every keyed device block (set when it is published or loaded) and
    the disk reads in flight per request. Callers pass keys, block ids and request ids; the
    pool and the requests stay the KV manager's."""

    def __init__(self, tiers: KVTiers, codec: BlockCodec, num_blocks: int,
                 load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.tiers = tiers
        self.codec = codec
        self.load_timeout_s = load_timeout_s
        self.expires_at = [math.inf] * num_blocks
        self._loads: dict[str, _Load] = {}

    # ------------------------------------------------------------------ down
    def on_evict(self, block_ids: list[int], keys: list[bytes]) -> None:
        """BlockPool hook: the blocks' content is still intact; keep a copy of each one
        not yet expired in host RAM (one batched copy)."""
        live = [i for i, block_id in enumerate(block_ids) if self.is_live(block_id)]
        if not live:
            return
        ids = [block_ids[i] for i in live]
        self.tiers.put_copied([keys[i] for i in live],
                             self.codec.save_many_later(ids, [self.expires_at[b] for b in ids]))

    def on_publish(self, block_ids: list[int], keys: list[bytes], retention: str) -> None:
        """Freshly computed blocks became addressable: stamp their expiry, write them to
        disk (one batched copy)."""
        expires_at = self._expiry(retention)
        for block_id in block_ids:
            self.expires_at[block_id] = expires_at
        if self.tiers.has_disk or self.tiers.has_shared:
            self.tiers.write_behind(
                keys, self.codec.save_many_later(block_ids, [expires_at] * len(block_ids)))

    def store(self, key: bytes, payload, retention: str) -> None:
        """Keep a block that arrived from elsewhere (a prefill worker's hand-off) in host
        RAM, stamped with the expiry of its retention class. payload: the raw bytes of one
        block of this pool's layout (the caller checked its size); the tiers own it now."""
        codec = self.codec
        self.tiers.put(key, BlockEntry(payload, codec.dtype, codec.shape, codec.block_size,
                                       self._expiry(retention), codec.encoding))

    def num_stored(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of `keys` the host, disk or shared tiers hold."""
        return len(self.tiers.lookup(keys))

    @property
    def can_store(self) -> bool:
        """Whether `store` has a host tier to keep blocks in."""
        return self.tiers.has_host

    def is_live(self, block_id: int) -> bool:
        return self.tiers.clock() < self.expires_at[block_id]

    def _expiry(self, retention: str) -> float:
        """The one place a stored block's expiry is computed (kvstore.retention's policy
        at the tiers' clock)."""
        return self.tiers.expiry(retention)

    # ------------------------------------------------------------------ up
    def start_load(self, req_id: str, keys: list[bytes]) -> None:
        """At admission: start reading the disk part of the prefix that `keys` continue,
        and the rest of it (what no local tier has) from the shared store."""
        if not keys or not (self.tiers.has_disk or self.tiers.has_shared):
            return
        tiers = self.tiers.lookup(keys)
        disk_keys = [key for key, tier in zip(keys, tiers) if tier == DISK]
        shared_keys = keys[len(tiers):] if self.tiers.shared_is_on else []
        if disk_keys or shared_keys:
            landed: dict[bytes, BlockEntry] = {}
            future = self.tiers.prefetch(disk_keys, landed, shared_keys)
            self._loads[req_id] = _Load(disk_keys + shared_keys, frozenset(shared_keys), landed,
                                        future, time.monotonic() + self.load_timeout_s)

    def is_loading(self, req_id: str) -> bool:
        """Its disk reads are still in flight and it has not waited too long for them."""
        load = self._loads.get(req_id)
        return (load is not None and not load.future.done()
                and time.monotonic() < load.deadline)

    def wait_for_loads(self, req_ids: Sequence[str]) -> bool:
        """Block until one of these requests' loads lands or times out; False if none
        was loading (then nothing waited)."""
        loads = [self._loads[r] for r in req_ids if self.is_loading(r)]
        if not loads:
            return False
        timeout = max(0.0, min(load.deadline for load in loads) - time.monotonic())
        concurrent.futures.wait([load.future for load in loads], timeout,
                                concurrent.futures.FIRST_COMPLETED)
        return True

    def find(self, req_id: str, keys: list[bytes]) -> list[TierHit]:
        """The leading blocks of `keys` the tiers hold (host RAM, or landed disk reads),
        stopping at the first miss or at an entry that does not fit the pool."""
        load = self._loads.get(req_id)
        if not keys or (load is None and not self.tiers.has_host):
            return []
        landed = load.landed if load else {}
        loaded = set(load.keys) if load else set()
        shared = load.shared_keys if load else frozenset()
        hits = []
        for key, entry in zip(keys, self.tiers.get_host_many(keys)):
            entry = entry or landed.get(key)
            if entry is None or not self.codec.fits(entry):
                break
            tier = HOST if key not in loaded else SHARED if key in shared else DISK
            hits.append(TierHit(entry, tier))
        return hits

    def load(self, block_ids: list[int], entries: list[BlockEntry]) -> None:
        """Copy tier entries into freshly allocated device blocks (one batched copy)."""
        self.codec.load_many(block_ids, entries)
        for block_id, entry in zip(block_ids, entries):
            self.expires_at[block_id] = entry.expires_at

    def forget(self, req_id: str) -> None:
        """Drop a request's load state (reads still running just fill host RAM)."""
        self._loads.pop(req_id, None)


def store_stats(kv: KVStats, store: dict[str, float]) -> KVStats:
    """kv with the tier figures of `kvstore.store.KVStore.stats()` (its flat names) filled
    in: the one place those names are read."""
    def tier(name: str, hit_tokens: float) -> KVTierStats:
        return KVTierStats(hit_tokens=hit_tokens, hits=store.get(f"hits_{name}", 0.0),
                           bytes=store.get(f"bytes_{name}", 0.0),
                           entries=store.get(f"entries_{name}", 0.0),
                           evictions=store.get(f"evictions_{name}", 0.0))

    shared = None
    if "shared_on" in store:
        shared = SharedTierStats(**{name: store[f"shared_{name}"]
                                    for name in SharedTierStats.__struct_fields__
                                    if f"shared_{name}" in store})
    return msgspec.structs.replace(
        kv, host=tier(HOST, kv.host.hit_tokens), disk=tier(DISK, kv.disk.hit_tokens),
        shared=tier(SHARED, kv.shared.hit_tokens), misses=store.get("misses", 0.0),
        spills=store.get("spills", 0.0), expirations=store.get("expirations", 0.0),
        corrupt_dropped=store.get("corrupt_dropped", 0.0),
        write_errors=store.get("write_errors", 0.0), shared_tier=shared)

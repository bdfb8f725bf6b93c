"""`SharedTier`: the fleet-shared KV tier below host RAM — one store many workers read.

Owns the traffic to one shared store (a `SharedBackend`: Redis / Valkey in
`kvstore.redis_tier`, a POSIX shared directory in `kvstore.shared_dir`): the write-behind
queue with its in-flight byte bound, the circuit breaker, the known-present key set that
saves re-sending blocks, and the tier's counters and read latencies.

Every value is a block file image (`kvstore.blockfile`): the namespace and key inside it and
its CRC are checked on every read, so a truncated, bit-flipped or foreign value (another
model's or tenant's) is a miss, never a wrong hit. Keys chain (a block's key covers every
token before it), so a read stops at the first missing block.

Guarantees to callers (who run on the tiers' event loop):
  * `put` never blocks and never raises; a full queue, an off tier or a store error drops
    the block (counted). Writes go out in batches from one task.
  * `get_chain` never raises and waits at most `op_timeout_s`; while the breaker is open it
    returns misses at once without touching the store.
  * A store that is down at start leaves the tier off (the breaker open); a probe every
    cooldown turns it back on when the store answers.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from duplex.kvstore.blockfile import ReadResult, Status
from duplex.kvstore.breaker import CircuitBreaker
from duplex.kvstore.entry import BlockEntry

log = logging.getLogger(__name__)

_COUNTERS = ("hits", "misses", "puts", "dedup_skipped", "write_dropped", "write_errors",
             "write_rejected", "read_errors", "corrupt_dropped", "expired", "bytes_read",
             "bytes_written", "reads")
_MAX_BATCH = 32  # blocks per write round trip
_READ_BATCH = 16  # blocks per read round trip (SmolLM2 fp32: 16 x 0.7 MB)
_KNOWN_KEYS = 1 << 16  # keys remembered as present in the store (saves re-sending them)
_LATENCIES = 512  # recent read round trips kept for p50 / p99
_REFRESH_S = 10.0  # how often the store's own size is asked for


class StoreFault(Exception):
    """The store cannot be reached or did not answer: a breaker failure, never a client's."""


class SharedBackend(Protocol):
    """One shared store. Methods raise `StoreFault` (or OSError / asyncio.TimeoutError) when
    the store is unreachable; a bad value is a `ReadResult` status, never an exception."""
    kind: str  # "redis" | "dir"

    async def start(self) -> None: ...
    async def read(self, keys: Sequence[bytes]) -> list[ReadResult]: ...
    async def write(self, items: list[tuple[bytes, BlockEntry]], now: float) -> int:
        """Store every item that is not there yet; returns how many the store refused
        (full, e.g. Redis maxmemory with noeviction) without being unreachable."""
    async def ping(self) -> None: ...
    async def refresh(self) -> None:
        """Update what `stats` reports of the store itself (its `store_bytes`)."""
    async def close(self) -> None: ...
    def stats(self) -> dict[str, float]: ...


@dataclasses.dataclass(frozen=True)
class SharedConfig:
    max_inflight_bytes: int = 64 * 2**20  # queued, unsent payload; beyond it puts drop
    op_timeout_s: float = 0.5  # one read round trip (a request may be waiting on it), at most
    write_timeout_s: float = 5.0  # one batch of writes (nobody waits on it), at most
    max_failures: int = 3  # consecutive faults that turn the tier off
    cooldown_s: float = 5.0  # off this long before a probe

    def __post_init__(self) -> None:
        if self.max_inflight_bytes <= 0 or self.op_timeout_s <= 0:
            raise ValueError(f"in-flight bytes and timeout must be positive: {self}")


class SharedTier:
    def __init__(self, backend: SharedBackend, config: SharedConfig = SharedConfig(), *,
                 clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.config = config
        self._clock = clock
        self.breaker = CircuitBreaker(config.max_failures, config.cooldown_s)
        self._queue: collections.deque[tuple[bytes, BlockEntry]] = collections.deque()
        self._queued: set[bytes] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight_bytes = 0
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._latencies: collections.deque[float] = collections.deque(maxlen=_LATENCIES)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._task: asyncio.Task | None = None
        self._refreshed_at = 0.0
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect; a store that does not answer leaves the tier off, never fails start."""
        try:
            await asyncio.wait_for(self.backend.start(), self.config.op_timeout_s * 4)
        except Exception as exc:  # noqa: BLE001 - any fault: start cold, probe later
            log.warning("shared KV tier (%s) is off: %s", self.backend.kind, exc)
            self.breaker.trip()
        self._task = asyncio.create_task(self._drain(), name="kvstore-shared-writer")

    async def close(self) -> None:
        if self._closed:
            return
        await self.flush()
        self._closed = True
        self._wake.set()
        if self._task is not None:
            # The writer sees `_closed` and returns by itself. Cancelling alone is not
            # enough on Python 3.11: `asyncio.wait_for` drops a cancellation that lands
            # just as its inner await completes, and the loop would run on forever.
            done, _ = await asyncio.wait([self._task], timeout=self.config.write_timeout_s)
            if not done:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        await self.backend.close()

    async def flush(self) -> None:
        """Wait until every write queued so far was sent (or dropped)."""
        await self._idle.wait()

    @property
    def is_on(self) -> bool:
        return self.breaker.is_on

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, entry: BlockEntry) -> bool:
        """Queue `entry` for the store; False when dropped or already known there."""
        if key in self._known or key in self._queued:
            self._counts["dedup_skipped"] += 1
            return False
        full = self._inflight_bytes + entry.nbytes > self.config.max_inflight_bytes
        if self._closed or full or not self.breaker.is_on or entry.is_expired(self._clock()):
            self._counts["write_dropped"] += 1
            return False
        self._queue.append((key, entry))
        self._queued.add(key)
        self._inflight_bytes += entry.nbytes
        self._idle.clear()
        self._wake.set()
        return True

    async def _drain(self) -> None:
        while not self._closed:
            await self._refresh()
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.config.cooldown_s)
                except asyncio.TimeoutError:
                    await self._probe()
                continue
            batch = [self._queue.popleft() for _ in range(min(_MAX_BATCH, len(self._queue)))]
            await self._send(batch)
            for key, entry in batch:
                self._queued.discard(key)
                self._inflight_bytes -= entry.nbytes

    async def _send(self, batch: list[tuple[bytes, BlockEntry]]) -> None:
        if not self.breaker.allow():
            self._counts["write_dropped"] += len(batch)
            return
        try:
            num_refused = await asyncio.wait_for(self.backend.write(batch, self._clock()),
                                                 self.config.write_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a store fault drops the batch, never raises
            self._fault("write", exc)
            self._counts["write_errors"] += len(batch)
            return
        self.breaker.record_success()
        self._counts["write_rejected"] += num_refused
        self._counts["puts"] += len(batch) - num_refused
        self._counts["bytes_written"] += sum(e.nbytes for _, e in batch)
        for key, _ in batch:
            self._remember(key)

    async def _refresh(self) -> None:
        """Now and then, while on, ask the store how big it is (a failure is no fault)."""
        now = time.monotonic()
        if not self.breaker.is_on or now - self._refreshed_at < _REFRESH_S:
            return
        self._refreshed_at = now
        try:
            await asyncio.wait_for(self.backend.refresh(), self.config.op_timeout_s)
        except Exception:  # noqa: BLE001 - a figure for /v1/status, never worth a fault
            pass

    async def _probe(self) -> None:
        """While off: one ping per cooldown turns the tier back on when the store answers."""
        if self.breaker.is_on or not self.breaker.allow():
            return
        try:
            await asyncio.wait_for(self.backend.ping(), self.config.op_timeout_s)
        except Exception as exc:  # noqa: BLE001
            self._fault("probe", exc)
            return
        log.warning("shared KV tier (%s) is back on", self.backend.kind)
        self.breaker.record_success()

    # ------------------------------------------------------------------ reads
    async def get_chain(self, keys: Sequence[bytes]) -> list[BlockEntry | None]:
        """Entries of the leading blocks of `keys` the store holds, None from the first
        miss on (a chained key after a miss is useless). Read `_READ_BATCH` blocks per
        round trip, so one reply stays small and each is bounded by the timeout."""
        found: list[BlockEntry | None] = []
        for start in range(0, len(keys), _READ_BATCH):
            batch = await self._read_batch(keys[start:start + _READ_BATCH])
            found += batch
            if not batch or batch[-1] is None:
                break
        num_hits = sum(e is not None for e in found)
        self._counts["hits"] += num_hits
        self._counts["misses"] += len(keys) - num_hits
        return found + [None] * (len(keys) - len(found))

    async def _read_batch(self, keys: Sequence[bytes]) -> list[BlockEntry | None]:
        """One round trip: the leading entries found, then None from the first miss on."""
        if not self.breaker.allow():
            return []
        start = time.perf_counter()
        try:
            results = await asyncio.wait_for(self.backend.read(list(keys)),
                                             self.config.op_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a store fault is a miss
            self._fault("read", exc)
            self._counts["read_errors"] += 1
            return []
        self.breaker.record_success()
        self._latencies.append(time.perf_counter() - start)
        self._counts["reads"] += 1
        found: list[BlockEntry | None] = [None] * len(keys)
        for i, (key, result) in enumerate(zip(keys, results)):
            found[i] = self._accept(key, result)
            if found[i] is None:
                break
        return found

    def _accept(self, key: bytes, result: ReadResult) -> BlockEntry | None:
        if result.status is Status.CORRUPT:
            self._counts["corrupt_dropped"] += 1
            log.warning("shared KV tier: dropped a bad value: %s", result.reason)
            return None
        entry = result.entry
        if entry is None:  # gone (evicted, expired, store restarted): send it again
            self._known.pop(key, None)
            return None
        if entry.is_expired(self._clock()):
            self._counts["expired"] += 1
            return None
        self._counts["bytes_read"] += entry.nbytes
        self._remember(key)
        return entry

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, float]:
        lat = sorted(self._latencies)
        pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]) if lat else (lambda q: 0.0)
        out = {name: float(v) for name, v in self._counts.items()}
        out.update(on=float(self.breaker.is_on), breaker_trips=float(self.breaker.num_trips),
                   inflight_bytes=float(self._inflight_bytes),
                   read_p50_ms=pick(0.5) * 1e3, read_p99_ms=pick(0.99) * 1e3)
        out.update({name: float(v) for name, v in self.backend.stats().items()})
        return out

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > _KNOWN_KEYS:
            self._known.popitem(last=False)

    def forget_known(self) -> None:
        """Forget which keys the store holds (after it lost them, e.g. a restart)."""
        self._known.clear()

    def _fault(self, what: str, exc: BaseException) -> None:
        was_on = self.breaker.is_on
        self.breaker.record_failure()
        if was_on and not self.breaker.is_on:
            log.warning("shared KV tier (%s) is off after %s faults (%s: %r); retry in %.0f s",
                        self.backend.kind, self.breaker.max_failures, what, exc,
                        self.config.cooldown_s)
            self._known.clear()  # the store may come back empty: send blocks again



def open_shared(url: str, namespace: bytes, capacity_bytes: int,
                config: SharedConfig = SharedConfig(), *,
                clock: Callable[[], float] = time.time) -> SharedTier:
    """The shared tier a `--kv-remote` value names: redis:// / valkey:// URL, or a shared
    directory (a path or file:// URL). Nothing connects until `start`."""
    from duplex.kvstore import redis_tier, shared_dir
    if redis_tier.is_redis_url(url):
        backend = redis_tier.RedisBackend(url, namespace, config.op_timeout_s)
    elif shared_dir.is_dir_url(url):
        backend = shared_dir.SharedDirBackend(shared_dir.dir_of(url), namespace, capacity_bytes,
                                              fsync=False)
    else:
        raise ValueError(f"--kv-remote must be redis://HOST:PORT/DB, valkey://..., or a "
                         f"shared directory path, got {url!r}")
    return SharedTier(backend, config, clock=clock)


def store_identity(url: str | None) -> str:
    """A short name for one shared store that workers announce, so the router knows which
    workers see each other's blocks ("" for none). A hash: URLs may carry passwords."""
    if not url:
        return ""
    return hashlib.blake2b(url.strip().rstrip("/").encode(), digest_size=8).hexdigest()

"""`DiskTier`: KV blocks as files on local disk, one namespace per tier, LRU-capped, with TTL.

Owns the files under ``<root>/<namespace hex>/`` (format: `kvstore.blockfile`), the in-memory
index of them (`_Index`: size, expiry, last-access order), the write-behind queue (`_Writer`)
and the TTL sweep.

Concurrency model. All index state lives on the event loop; file I/O runs on the tier's own
thread pool through `aiofiles` (one executor hop per whole operation: open + read + verify +
close is one hop, since each hop costs ~70 µs on these boxes). Every file *mutation* — write,
eviction, removal of an expired or corrupt file — goes through one queue drained by one task,
so a removal and a re-write of the same key can never interleave. Reads run concurrently.

Guarantees to callers:
  * `put` never blocks and never raises for I/O: writes happen later (dedup by key); a full
    disk or any OSError is counted in `write_errors` and the block is simply not stored.
  * `get` never raises and never returns wrong or partial bytes: a file that is truncated,
    damaged, foreign (other namespace, key, or layout version) or expired is a miss, is
    counted, and is removed. A read that races an eviction or sweep of its key is a miss.
  * One tier owns its namespace directory at a time (an exclusive `flock`); start-up fails
    with `KVStoreError` if the directory is unusable or already owned.
  * After a restart the index is rebuilt from the directory (sizes, mtimes = last access);
    expiries are learnt lazily, by the first `get` or `sweep` that reads the header.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import fcntl
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import aiofiles.os

from duplex.kvstore import blockfile
from duplex.kvstore.blockfile import ReadResult, Status
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.errors import KVStoreError
from duplex.kvstore.keys import KEY_BYTES, key_hex

log = logging.getLogger(__name__)

_COUNTERS = ("hits", "misses", "writes", "dedup_skipped", "write_dropped", "rejected",
             "write_errors", "evictions", "expirations", "corrupt_dropped", "vanished",
             "read_races", "read_errors", "temp_removed")
_WRITE, _UNLINK, _STOP = "write", "unlink", "stop"
_MAX_BATCH = 64  # queue ops the writer takes at once (one fsync round covers a batch)


@dataclasses.dataclass(frozen=True)
class DiskConfig:
    root: str
    # Model-level namespace: keys.namespace(model, dtype, block_size, layout), no tenant salt.
    # Keys already chain from their tenant's namespace, so one tier serves every tenant of a
    # model; this one guards against files of another model, dtype, block size or layout.
    namespace: bytes
    capacity_bytes: int  # file bytes (header + payload) on disk, at most
    sweep_interval_s: float = 600.0  # background TTL sweep period
    io_threads: int = 4
    max_pending_bytes: int = 256 * 2**20  # queued, unwritten payload; beyond it puts are dropped
    # fsync files and directories. False keeps writes atomic (rename) and reads verified
    # (CRC), but a crash may lose recent entries; for tests and throwaway caches.
    fsync: bool = True

    def __post_init__(self) -> None:
        if len(self.namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes")
        if self.capacity_bytes <= 0 or self.io_threads <= 0 or self.sweep_interval_s <= 0:
            raise ValueError(f"capacity, io_threads and sweep interval must be positive: {self}")

    @property
    def ns_dir(self) -> str:
        return os.path.join(self.root, key_hex(self.namespace))


@dataclasses.dataclass(slots=True)
class _Indexed:
    """What the index knows of one file; identity marks a generation (see `_settle`)."""
    num_bytes: int
    expires_at: float | None  # None: loaded by a scan, header not read yet


class _Index:
    """The files of one namespace dir as the tier knows them: size and expiry of each, in
    last-access order (oldest first), their total bytes, and the access stamps that file
    mtimes carry (so a restart rebuilds the order)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.entries: OrderedDict[bytes, _Indexed] = OrderedDict()  # oldest access first
        self.num_bytes = 0
        self._clock = clock
        self._stamp_ns = 0  # last access stamp handed out

    def load(self, found: list[tuple[bytes, int, int]]) -> None:
        """Index the files a scan found, oldest access first."""
        for key, num_bytes, mtime_ns in found:
            self.add(key, num_bytes, None)
            self._stamp_ns = max(self._stamp_ns, mtime_ns)

    def add(self, key: bytes, num_bytes: int, expires_at: float | None) -> None:
        self.entries[key] = _Indexed(num_bytes, expires_at)
        self.num_bytes += num_bytes

    def pop(self, key: bytes) -> _Indexed:
        indexed = self.entries.pop(key)
        self.num_bytes -= indexed.num_bytes
        return indexed

    def is_expired(self, key: bytes) -> bool:
        """Known to be expired (an entry whose header is unread is not)."""
        expires_at = self.entries[key].expires_at
        return expires_at is not None and self._clock() >= expires_at

    def lru_victim(self, capacity_bytes: int, num_bytes: int) -> bytes | None:
        """The least recently used key while `num_bytes` do not fit under the cap."""
        if self.entries and capacity_bytes - self.num_bytes < num_bytes:
            return next(iter(self.entries))
        return None

    def next_stamp(self) -> int:
        self._stamp_ns = max(self._stamp_ns + 1, time.time_ns())
        return self._stamp_ns


class _Writer:
    """The one task that writes and removes files, in queue order, a batch at a time; it
    owns the queue and the entries waiting in it (served from RAM meanwhile)."""

    def __init__(self, tier: DiskTier) -> None:
        self._tier = tier
        self.pending: dict[bytes, BlockEntry] = {}  # queued for writing, served from RAM
        self.pending_bytes = 0
        self.ops: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    def write(self, key: bytes, entry: BlockEntry) -> None:
        self.pending[key] = entry
        self.pending_bytes += entry.nbytes
        self.ops.put_nowait((_WRITE, key))

    def unlink(self, key: bytes) -> None:
        self.ops.put_nowait((_UNLINK, key))

    def stop(self) -> None:
        self.ops.put_nowait((_STOP, b""))

    async def drain(self) -> None:
        while True:
            ops = [await self.ops.get()]
            while not self.ops.empty() and len(ops) < _MAX_BATCH:
                ops.append(self.ops.get_nowait())
            try:
                for op, keys in _runs(ops):
                    if op == _STOP:
                        return
                    await (self._write_batch(keys) if op == _WRITE else self._unlink(keys))
            except Exception:
                log.exception("kvstore: disk writer failed on a batch of %d ops", len(ops))
            finally:
                for _ in ops:
                    self.ops.task_done()

    async def _write_batch(self, keys: list[bytes]) -> None:
        """Write queued entries, in chunks that fit the cap; a key leaves `pending` only
        once it is indexed or known not stored, so it is always findable meanwhile."""
        entries = [self.pending[key] for key in keys]
        try:
            accepted = [(k, e) for k, e in zip(keys, entries) if self._is_storable(e)]
            for chunk in _chunks(accepted, self._tier.config.capacity_bytes):
                await self._store(chunk)
        finally:
            for key, entry in zip(keys, entries):
                del self.pending[key]
                self.pending_bytes -= entry.nbytes

    def _is_storable(self, entry: BlockEntry) -> bool:
        tier = self._tier
        if entry.is_expired(tier.clock()):
            tier.counts["expirations"] += 1
            return False
        if blockfile.file_bytes(entry) > tier.config.capacity_bytes:
            tier.counts["rejected"] += 1
            return False
        return True

    async def _store(self, chunk: list[tuple[bytes, BlockEntry]]) -> None:
        """Write one chunk of files after evicting LRU files to make room for all of it."""
        tier = self._tier
        await self._make_room(sum(blockfile.file_bytes(e) for _, e in chunk))
        items = [blockfile.WriteItem(tier.path(k), blockfile.encode_header(
            tier.config.namespace, k, e), e.payload, tier.index.next_stamp()) for k, e in chunk]
        errors = await tier.run(blockfile.write_blocks, items, tier.config.fsync)
        for (key, entry), error in zip(chunk, errors):
            if error is None:
                tier.index.add(key, blockfile.file_bytes(entry), entry.expires_at)
                tier.counts["writes"] += 1
            else:
                tier.counts["write_errors"] += 1
                log.warning("kvstore: block %s not stored: %s", tier.path(key), error)

    async def _make_room(self, num_bytes: int) -> None:
        """Evict LRU files until `num_bytes` fit, removing them now (this is the writer
        task, so no later write of a victim can overtake its removal)."""
        tier, victims = self._tier, []
        while (key := tier.index.lru_victim(tier.config.capacity_bytes, num_bytes)) is not None:
            victims.append(key)
            tier.counts[_eviction_counter(tier.index, key)] += 1
            tier.index.pop(key)
        if victims:
            await self._unlink(victims)

    async def _unlink(self, keys: list[bytes]) -> None:
        try:
            await self._tier.run(_unlink_all, [self._tier.path(key) for key in keys])
        except OSError as exc:
            log.warning("kvstore: could not remove %d block files: %s", len(keys), exc)


class DiskTier:
    def __init__(self, config: DiskConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.index = _Index(clock)
        self.counts = dict.fromkeys(_COUNTERS, 0)
        self._writer = _Writer(self)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task] = []
        self._lock_fd: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open (creating) the namespace dir, lock it, rebuild the index, start the tasks."""
        if self._executor is not None or self._closed:
            raise KVStoreError("DiskTier.start() called twice")
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.config.io_threads, thread_name_prefix="kvstore-disk")
        try:
            self._lock_fd = await self.run(_open_dir, self.config.ns_dir)
            found, num_removed = await self.run(blockfile.scan, self.config.ns_dir)
        except OSError as exc:
            await self._release()
            raise KVStoreError(f"cannot index KV disk dir {self.config.ns_dir!r}: {exc}") from exc
        except BaseException:
            await self._release()
            raise
        self.index.load(found)
        self.counts["temp_removed"] += num_removed
        self._tasks = [asyncio.create_task(self._writer.drain(), name="kvstore-disk-writer"),
                       asyncio.create_task(self._sweep_forever(), name="kvstore-disk-sweep")]

    async def close(self) -> None:
        """Finish queued writes and removals, stop the tasks, release the directory."""
        if self._executor is None or self._closed:
            return
        await self.flush()
        self._closed = True
        self._writer.stop()
        self._tasks[1].cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._release()

    async def flush(self) -> None:
        """Wait until every write and removal queued so far is done."""
        if self._tasks and not self._closed:
            await self._writer.ops.join()

    # ------------------------------------------------------------------ API
    def put(self, key: bytes, entry: BlockEntry) -> bool:
        """Queue `entry` for writing; False if it is already stored or queued, expired,
        or the queue is full. Never blocks, never raises for I/O. Before `start` it only
        queues. A key a restart indexed counts as stored until its header is read (by a
        `get` or `sweep`), even if it turns out to have expired."""
        writer = self._writer
        if self._closed or writer.pending_bytes + entry.nbytes > self.config.max_pending_bytes:
            self.counts["write_dropped"] += 1
            return False
        if entry.is_expired(self.clock()):
            self.counts["rejected"] += 1
            return False
        if key in writer.pending or self._live(key) is not None:
            self.counts["dedup_skipped"] += 1
            return False
        writer.write(key, entry)
        return True

    async def get(self, key: bytes) -> BlockEntry | None:
        """The verified entry, or None (absent, expired, damaged, foreign or raced)."""
        entry = self._writer.pending.get(key)
        if entry is not None and not entry.is_expired(self.clock()):
            self.counts["hits"] += 1
            return entry
        indexed = self._live(key)
        if indexed is None or self._closed:
            self.counts["misses"] += 1
            return None
        self.index.entries.move_to_end(key)
        result = await self._read(key)
        entry = None if result is None else self._settle(key, indexed, result)
        self.counts["hits" if entry is not None else "misses"] += 1
        return entry

    def contains(self, key: bytes) -> bool:
        """Index only (no I/O): stored or queued, and not known to be expired."""
        entry = self._writer.pending.get(key)
        if entry is not None:
            return not entry.is_expired(self.clock())
        return self._live(key, drop=False) is not None

    def evict(self, num_bytes: int) -> int:
        """Evict LRU files until `num_bytes` are free under the cap; returns how many
        unexpired ones went. Files are removed by the writer task (see `flush`)."""
        num_evicted = 0
        while (key := self.index.lru_victim(self.config.capacity_bytes, num_bytes)) is not None:
            counter = _eviction_counter(self.index, key)
            self._drop(key, counter)
            num_evicted += counter == "evictions"
        return num_evicted

    async def sweep(self) -> int:
        """Learn unknown expiries, then drop every expired entry; returns how many."""
        await self._learn_expiries()
        now = self.clock()
        expired = [k for k, e in self.index.entries.items()
                   if e.expires_at is not None and now >= e.expires_at]
        for key in expired:
            self._drop(key, "expirations")
        return len(expired)

    def keys(self) -> list[bytes]:
        """Stored keys from least to most recently used (queued writes not included)."""
        return list(self.index.entries)

    def stats(self) -> dict[str, int]:
        return dict(self.counts, bytes=self.index.num_bytes, entries=len(self.index.entries),
                    pending=len(self._writer.pending), pending_bytes=self._writer.pending_bytes,
                    capacity_bytes=self.config.capacity_bytes)

    def path(self, key: bytes) -> str:
        return blockfile.block_path(self.config.ns_dir, key)

    # ------------------------------------------------------------------ index
    def _live(self, key: bytes, drop: bool = True) -> _Indexed | None:
        """The index entry unless absent or known to be expired (then dropped if `drop`)."""
        indexed = self.index.entries.get(key)
        if indexed is None or indexed.expires_at is None:
            return indexed
        if self.clock() < indexed.expires_at:
            return indexed
        if drop:
            self._drop(key, "expirations")
        return None

    def _drop(self, key: bytes, counter: str) -> None:
        """Forget `key` now; its file is removed by the writer task, in queue order."""
        self.index.pop(key)
        self.counts[counter] += 1
        self._writer.unlink(key)

    # ------------------------------------------------------------------ reads
    async def _read(self, key: bytes) -> ReadResult | None:
        """The read's result; None if it could not run (the file is not to blame)."""
        try:
            return await self.run(blockfile.read_block, self.path(key),
                                  self.config.namespace, key, self.index.next_stamp())
        except Exception:  # a bug or a dead executor must not reach the caller
            log.exception("kvstore: read of %s failed", self.path(key))
            self.counts["read_errors"] += 1
            return None

    def _settle(self, key: bytes, indexed: _Indexed, result: ReadResult) -> BlockEntry | None:
        """Turn a finished read into an entry or a miss, dropping what must go."""
        if self.index.entries.get(key) is not indexed:  # evicted, swept or replaced meanwhile
            self.counts["read_races"] += 1
            return None
        if result.status is Status.MISSING:
            self._drop(key, "vanished")
            return None
        if result.status is Status.CORRUPT:
            log.warning("kvstore: dropping corrupt block file %s: %s", self.path(key),
                        result.reason)
            self._drop(key, "corrupt_dropped")
            return None
        indexed.expires_at = result.entry.expires_at
        return result.entry if self._live(key) is not None else None

    async def _learn_expiries(self) -> None:
        """Read the headers of entries indexed by a scan, to know when they expire; a file
        gone meanwhile or found corrupt is dropped."""
        unknown = [(k, e) for k, e in self.index.entries.items() if e.expires_at is None]
        if not unknown:
            return
        headers = await self.run(_read_headers, [self.path(k) for k, _ in unknown],
                                 self.config.namespace, [k for k, _ in unknown])
        for (key, indexed), header in zip(unknown, headers):
            if self.index.entries.get(key) is not indexed:
                continue
            if header is None:
                self._drop(key, "vanished")
            elif isinstance(header, str):
                log.warning("kvstore: dropping corrupt block file %s: %s", self.path(key),
                            header)
                self._drop(key, "corrupt_dropped")
            else:
                indexed.expires_at = header.expires_at

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("kvstore: TTL sweep failed")

    # ------------------------------------------------------------------ plumbing
    async def run(self, fn, *args):
        """Run blocking `fn(*args)` on the tier's I/O threads (one aiofiles executor hop)."""
        return await aiofiles.os.wrap(fn)(*args, executor=self._executor)

    async def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the fd drops the flock
            self._lock_fd = None
        self._closed = True
        self._executor.shutdown(wait=False)


def _eviction_counter(index: _Index, key: bytes) -> str:
    """An LRU victim that had already expired counts as an expiration."""
    return "expirations" if index.is_expired(key) else "evictions"


def _open_dir(ns_dir: str) -> int:
    """Create `ns_dir`, prove it writable, lock it; returns the lock fd. KVStoreError if not."""
    try:
        os.makedirs(ns_dir, exist_ok=True)
        probe = os.path.join(ns_dir, f".probe{blockfile.TMP_SUFFIX}")
        with open(probe, "wb") as f:
            f.write(b"probe")
        os.unlink(probe)
        fd = os.open(os.path.join(ns_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise KVStoreError(f"KV disk dir {ns_dir!r} is unusable: "
                           f"{exc.strerror or exc} ({type(exc).__name__})") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise KVStoreError(f"KV disk dir {ns_dir!r} is in use by another DiskTier") from exc
    return fd


def _read_headers(paths: list[str], ns: bytes,
                  keys: list[bytes]) -> list[blockfile.Header | str | None]:
    return [blockfile.read_header(p, ns, k) for p, k in zip(paths, keys)]


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        blockfile.unlink_quietly(path)


def _runs(ops: list[tuple[str, bytes]]) -> list[tuple[str, list[bytes]]]:
    """Consecutive ops of one kind grouped, order kept: [(op, [key, ...]), ...]."""
    runs: list[tuple[str, list[bytes]]] = []
    for op, key in ops:
        if runs and runs[-1][0] == op:
            runs[-1][1].append(key)
        else:
            runs.append((op, [key]))
    return runs


def _chunks(pairs: list[tuple[bytes, BlockEntry]],
            max_bytes: int) -> list[list[tuple[bytes, BlockEntry]]]:
    """Split (key, entry) pairs into runs whose files total at most `max_bytes` each."""
    chunks: list[list[tuple[bytes, BlockEntry]]] = []
    total = max_bytes + 1
    for pair in pairs:
        size = blockfile.file_bytes(pair[1])
        if total + size > max_bytes:
            chunks.append([])
            total = 0
        chunks[-1].append(pair)
        total += size
    return chunks

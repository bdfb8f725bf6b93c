"""`SharedDirBackend`: the shared KV tier as a directory many workers on many hosts use at
once (any POSIX shared filesystem: NFS, CephFS, Lustre, 3FS; `--kv-remote /mnt/kv`).

Owns the files under ``<root>/<model namespace hex>/<ab>/<key hex>`` (the block file format
of `kvstore.blockfile`, the same one the private disk tier writes) and the sweep that keeps
them under a size budget and their expiry. There is no index in any process: the directory
is the index, so what one worker publishes every other sees at once.

Multi-writer scheme (lock-free for data, a lease only to avoid duplicate work):
  * publish = write a uniquely named temp file next to the target, rename over the target
    (no fsync by default: a cache may lose entries in a crash, and the CRC turns a torn file
    into a miss; fsync on NFS costs a server round trip per file). Rename is atomic, so a reader sees no file, an old complete file or the new
    complete file, never a partial one. Two writers racing on one key both rename a
    complete image of the same content address; the last rename wins, both are valid.
  * read = open, read, verify namespace, key, size and CRC. A file that vanishes under a
    reader (swept, evicted) is a miss; an open file stays readable after an unlink (POSIX).
    A damaged file is a miss and is unlinked.
  * eviction = unlink only. Whoever holds the sweep lease scans the directory, unlinks
    expired files (header read) and then the least recently used files (mtime; a read hit
    stamps it) until the total is under `capacity_bytes`. An unlink that finds nothing is
    fine, so sweeps need no coordination to be correct: two sweepers can at worst evict a
    little more than needed, never corrupt or half-remove an entry.
  * the lease is ``<ns dir>/.sweep.lease``, created with O_EXCL; the holder removes it when
    done. A lease older than `lease_s` (its holder died) is renamed away by one taker (only
    one rename of it succeeds) and then recreated with O_EXCL, so at most one sweep runs.
  * temp files older than `lease_s` are leftovers of a killed writer; the sweep removes them
    (younger ones may be another host's write in progress and are left alone).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import time
from collections.abc import Sequence

from duplex.kvstore import blockfile
from duplex.kvstore.blockfile import ReadResult, Status, WriteItem
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.keys import key_hex

LEASE_NAME = ".sweep.lease"


def is_dir_url(url: str) -> bool:
    return url.startswith(("file://", "/", "./", "~"))


def dir_of(url: str) -> str:
    return os.path.expanduser(url.removeprefix("file://"))


class SharedDirBackend:
    kind = "dir"

    def __init__(self, root: str, namespace: bytes, capacity_bytes: int, *,
                 sweep_interval_s: float = 60.0, lease_s: float = 300.0, fsync: bool = True,
                 io_threads: int = 4) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.namespace = namespace
        self.ns_dir = os.path.join(root, key_hex(namespace))
        self.capacity_bytes = capacity_bytes
        self.sweep_interval_s = sweep_interval_s
        self.lease_s = lease_s
        self.fsync = fsync
        self._executor = concurrent.futures.ThreadPoolExecutor(
            io_threads, thread_name_prefix="kvstore-shared-dir")
        self._sweeper: asyncio.Task | None = None
        self._counts = dict.fromkeys(("sweeps", "swept_expired", "swept_evicted",
                                      "temp_removed"), 0)
        self.last_sweep_bytes = 0  # total file bytes the last sweep found (after it)

    async def start(self) -> None:
        await self._run(os.makedirs, self.ns_dir, exist_ok=True)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="kvstore-dir-sweep")

    async def ping(self) -> None:
        if not await self._run(os.path.isdir, self.ns_dir):
            raise OSError(f"shared KV dir {self.ns_dir!r} is not reachable")

    async def read(self, keys: Sequence[bytes]) -> list[ReadResult]:
        return await self._run(self._read_chain, list(keys))

    def _read_chain(self, keys: list[bytes]) -> list[ReadResult]:
        stamp = time.time_ns()
        results = []
        for key in keys:
            path = blockfile.block_path(self.ns_dir, key)
            result = blockfile.read_block(path, self.namespace, key, stamp)
            if result.status is Status.CORRUPT:
                blockfile.unlink_quietly(path)
            results.append(result)
            if result.status is not Status.OK:
                break  # keys chain: nothing after a miss is usable
        return results + [ReadResult(Status.MISSING)] * (len(keys) - len(results))

    async def write(self, items: list[tuple[bytes, BlockEntry]], now: float) -> int:
        stamp = time.time_ns()
        batch = [WriteItem(blockfile.block_path(self.ns_dir, key),
                           blockfile.encode_header(self.namespace, key, entry),
                           entry.payload, stamp) for key, entry in items]
        errors = await self._run(self._write_new, batch)
        failed = [e for e in errors if e is not None]
        if failed and len(failed) == len(errors) and not await self._run(os.path.isdir,
                                                                          self.ns_dir):
            raise failed[0]  # the share itself is gone: a store fault
        return len(failed)  # e.g. ENOSPC: refused, counted, not a fault

    def _write_new(self, batch: list[WriteItem]) -> list[OSError | None]:
        """Write the items whose file is not there yet (another worker may have published
        the same block; its bytes are as good)."""
        new = [item for item in batch if not os.path.exists(item.path)]
        errors = dict(zip(map(id, new), blockfile.write_blocks(new, self.fsync)))
        return [errors.get(id(item)) for item in batch]

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def refresh(self) -> None:
        pass  # the size is measured by each sweep

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self._counts.items()},
                "store_bytes": float(self.last_sweep_bytes)}

    # ------------------------------------------------------------------ sweep
    async def sweep(self) -> bool:
        """One sweep if this process gets the lease; False if another holds it."""
        return await self._run(self._sweep_once)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except OSError:
                pass  # the share is away; the next sweep tries again

    def _sweep_once(self) -> bool:
        lease = os.path.join(self.ns_dir, LEASE_NAME)
        if not self._take_lease(lease):
            return False
        try:
            self._sweep_files()
        finally:
            blockfile.unlink_quietly(lease)
        self._counts["sweeps"] += 1
        return True

    def _take_lease(self, lease: str) -> bool:
        for _ in range(2):
            try:
                fd = os.open(lease, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if not self._break_stale(lease):
                    return False
                continue
            os.write(fd, f"{os.uname().nodename} {os.getpid()}\n".encode())
            os.close(fd)
            return True
        return False

    def _break_stale(self, lease: str) -> bool:
        try:
            if time.time() - os.stat(lease).st_mtime < self.lease_s:
                return False
            os.rename(lease, f"{lease}.{secrets.token_hex(4)}.stale")  # one taker wins
        except FileNotFoundError:
            return True  # released meanwhile: try to take it
        except OSError:
            return False
        return True

    def _sweep_files(self) -> None:
        files = self._scan()  # (mtime_ns, size, key), oldest first
        now = time.time()
        total, live = 0, []
        for mtime, size, key in files:
            header = blockfile.read_header(blockfile.block_path(self.ns_dir, key),
                                           self.namespace, key)
            if header is None:
                continue  # vanished
            if isinstance(header, str) or now >= header.expires_at:
                self._counts["swept_expired"] += blockfile.unlink_quietly(
                    blockfile.block_path(self.ns_dir, key))
                continue
            live.append((mtime, size, key))
            total += size
        for mtime, size, key in live:
            if total <= self.capacity_bytes:
                break
            self._counts["swept_evicted"] += blockfile.unlink_quietly(
                blockfile.block_path(self.ns_dir, key))
            total -= size
        self.last_sweep_bytes = total

    def _scan(self) -> list[tuple[int, int, bytes]]:
        found = []
        old_ns = (time.time() - self.lease_s) * 1e9
        for sub in os.scandir(self.ns_dir):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for item in os.scandir(sub.path):
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if item.name.endswith(blockfile.TMP_SUFFIX):
                    if st.st_mtime_ns < old_ns:
                        self._counts["temp_removed"] += blockfile.unlink_quietly(item.path)
                elif len(item.name) == 32 and item.name.startswith(sub.name):
                    try:
                        found.append((st.st_mtime_ns, st.st_size, bytes.fromhex(item.name)))
                    except ValueError:
                        continue  # not ours
        found.sort()
        return found

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

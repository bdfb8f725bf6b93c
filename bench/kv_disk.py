"""Read throughput of the disk tier next to plain file reads of the same bytes.

Owns one measurement, `measure_read_mb_s`. What the figures mean:

* Both figures read files this process has just written, so unless `cold=True` drops them
  from the OS page cache they measure page-cache reads (memory copies, syscalls, and for the
  tier: executor hops, header checks and the CRC), not the device.
* `cold=True` (the default) asks the kernel to drop *only these files'* pages
  (``posix_fadvise(DONTNEED)`` after fsync), so reads go to the block device — no global
  ``drop_caches`` on a shared box. On a virtual disk the hypervisor may still cache, so the
  "device" can be faster than real hardware; report the figure together with `cold`.
* `tier_read_mb_s` reads every block through `DiskTier.get`, all requests in flight at once
  and all results held (as `KVStore.get_many` does: fresh memory, so page faults count);
  `tier_serial_read_mb_s` awaits one block at a time and drops it; `raw_read_mb_s` reads
  equally sized plain files sequentially with `open().read()`, dropping each. Tier reads
  include the CRC-32 check (~7 GB/s) and one executor hop per block.
"""
from __future__ import annotations

import asyncio
import os
import time

from duplex.kvstore.blockfile import HEADER_BYTES
from duplex.kvstore.disk import DiskConfig, DiskTier
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.keys import block_keys, namespace

_BENCH_NS = namespace("diskbench", "uint8", 1, "opaque")


def measure_read_mb_s(root: str, block_bytes: int, num_blocks: int, *,
                      cold: bool = True) -> dict[str, float]:
    """Write `num_blocks` blocks of `block_bytes` under `root` through a DiskTier, then read
    them back through a fresh tier and as plain files; MB/s = 1e6 bytes of payload / s."""
    if block_bytes <= 0 or num_blocks <= 0:
        raise ValueError("block_bytes and num_blocks must be positive")
    return asyncio.run(ameasure_read_mb_s(root, block_bytes, num_blocks, cold=cold))


async def ameasure_read_mb_s(root: str, block_bytes: int, num_blocks: int, *,
                             cold: bool = True) -> dict[str, float]:
    """`measure_read_mb_s` for callers already inside an event loop."""
    keys = block_keys(_BENCH_NS, range(num_blocks), 1)
    config = DiskConfig(os.path.join(root, "tier"), _BENCH_NS,
                        capacity_bytes=2 * num_blocks * (block_bytes + HEADER_BYTES))
    await _write_blocks(config, keys, block_bytes)
    tier_s, tier_serial_s = await _read_blocks(config, keys, cold)
    raw_s = await asyncio.to_thread(_raw_read_s, os.path.join(root, "raw"), block_bytes,
                                    num_blocks, cold)
    total_mb = block_bytes * num_blocks / 1e6
    return {"tier_read_mb_s": total_mb / tier_s, "tier_serial_read_mb_s": total_mb / tier_serial_s,
            "raw_read_mb_s": total_mb / raw_s, "block_bytes": float(block_bytes),
            "num_blocks": float(num_blocks), "cold": float(cold)}


async def _write_blocks(config: DiskConfig, keys: list[bytes], block_bytes: int) -> None:
    tier = DiskTier(config)
    await tier.start()
    expires_at = time.time() + 3600
    for i, key in enumerate(keys):
        payload = i.to_bytes(8, "little") * (block_bytes // 8) + bytes(block_bytes % 8)
        tier.put(key, BlockEntry(payload, "uint8", (block_bytes,), 1, expires_at))
        if i % 64 == 63:
            await tier.flush()  # bound the write-behind queue
    await tier.close()


async def _read_blocks(config: DiskConfig, keys: list[bytes], cold: bool) -> tuple[float, float]:
    """Seconds to read all blocks concurrently, then one at a time, via a fresh tier (no
    queued writes, so nothing is served from process memory)."""
    tier = DiskTier(config)
    await tier.start()
    try:
        _maybe_drop_cache([tier.path(k) for k in keys], cold)
        start = time.perf_counter()
        num_found = sum(e is not None for e in await asyncio.gather(*map(tier.get, keys)))
        concurrent_s = time.perf_counter() - start
        _maybe_drop_cache([tier.path(k) for k in keys], cold)
        start = time.perf_counter()
        for key in keys:  # each entry dropped at once, as a consumer copying it out would
            num_found += await tier.get(key) is not None
        serial_s = time.perf_counter() - start
    finally:
        await tier.close()
    if num_found != 2 * len(keys):
        raise RuntimeError(f"diskbench: blocks missing on read back: {tier.stats()}")
    return concurrent_s, serial_s


def _raw_read_s(directory: str, block_bytes: int, num_blocks: int, cold: bool) -> float:
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"{i:08d}") for i in range(num_blocks)]
    payload = os.urandom(block_bytes)
    for path in paths:
        with open(path, "wb") as f:
            f.write(payload)
            os.fsync(f.fileno())
    _maybe_drop_cache(paths, cold)
    start = time.perf_counter()
    num_read = 0
    for path in paths:
        with open(path, "rb") as f:
            num_read += len(f.read())
    elapsed = time.perf_counter() - start
    assert num_read == block_bytes * num_blocks, "raw files changed under the benchmark"
    return elapsed


def _maybe_drop_cache(paths: list[str], cold: bool) -> None:
    """Drop these files' clean pages from the page cache (they are fsynced, so clean)."""
    if not cold:
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

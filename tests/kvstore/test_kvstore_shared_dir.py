"""The shared-directory tier with several writers: processes writing and sweeping one
directory at once under a size budget, the sweep lease, files vanishing under readers,
and leftovers of killed writers."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from duplex.kvstore import blockfile
from duplex.kvstore.blockfile import Status
from duplex.kvstore.shared_dir import LEASE_NAME, SharedDirBackend
from kvstore_factories import NS, make_entry, make_keys

REPO = Path(__file__).resolve().parents[2]
BLOCK = 8192
FILE = blockfile.HEADER_BYTES + BLOCK

WRITER = """
import asyncio, sys, time
sys.path.insert(0, {kv_tests!r})
from duplex.kvstore.shared_dir import SharedDirBackend
from kvstore_factories import NS, make_entry, make_keys

async def main():
    backend = SharedDirBackend({root!r}, NS, {budget}, sweep_interval_s=3600, fsync=False)
    await backend.start()
    keys = make_keys(40, salt={salt})
    for i in range(0, 40, 4):
        batch = [(k, make_entry({salt} * 100 + i + j, {block}, now=time.time()))
                 for j, k in enumerate(keys[i:i + 4])]
        await backend.write(batch, time.time())
        await backend.sweep()
    await backend.close()
asyncio.run(main())
"""


def files_in(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and len(p.name) == 32]


async def test_processes_writing_and_sweeping_one_dir_keep_it_valid_and_bounded(tmp_path):
    budget = 30 * FILE
    code = [WRITER.format(kv_tests=str(Path(__file__).parent), root=str(tmp_path), salt=s,
                          budget=budget, block=BLOCK) for s in (1, 2, 3)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", c], env=env) for c in code]
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    backend = SharedDirBackend(str(tmp_path), NS, budget, fsync=False)
    await backend.start()
    assert await backend.sweep()  # no lease left behind by the writers
    remaining = files_in(tmp_path)
    assert 0 < len(remaining) <= 30
    keys = [bytes.fromhex(p.name) for p in remaining]
    for key in keys:  # one at a time: a chain read would stop at the first gap
        assert (await backend.read([key]))[0].status is Status.OK, "every surviving file is whole"
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob(LEASE_NAME))
    await backend.close()


async def test_sweep_drops_expired_first_then_least_recently_used(tmp_path):
    backend = SharedDirBackend(str(tmp_path), NS, 3 * FILE, fsync=False)
    await backend.start()
    now = time.time()
    keys = make_keys(5, salt=4)
    expired = make_entry(0, BLOCK, now=now - 8 * 86_400)  # chat TTL is 7 days
    await backend.write([(keys[0], expired)], now)
    for i, key in enumerate(keys[1:], 1):
        await backend.write([(key, make_entry(i, BLOCK, now=now))], now)
        path = blockfile.block_path(backend.ns_dir, key)
        os.utime(path, ns=(time.time_ns() + i * 10**9,) * 2)  # keys[1] least recent
    assert await backend.sweep()
    left = {bytes.fromhex(p.name) for p in files_in(tmp_path)}
    assert left == set(keys[2:])
    assert backend.stats()["swept_expired"] == 1 and backend.stats()["swept_evicted"] == 1
    await backend.close()


async def test_a_held_lease_skips_the_sweep_and_a_stale_one_is_taken(tmp_path):
    backend = SharedDirBackend(str(tmp_path), NS, FILE, fsync=False, lease_s=60)
    await backend.start()
    lease = Path(backend.ns_dir) / LEASE_NAME
    lease.write_text("other-host 1\n")
    assert not await backend.sweep(), "another host is sweeping"
    old = time.time() - 120
    os.utime(lease, (old, old))
    assert await backend.sweep(), "its holder died: the lease is taken"
    assert not lease.exists()
    await backend.close()


async def test_file_vanishing_under_a_reader_is_a_miss(tmp_path):
    backend = SharedDirBackend(str(tmp_path), NS, 1 << 30, fsync=False)
    await backend.start()
    keys = make_keys(3, salt=5)
    await backend.write([(k, make_entry(i, BLOCK, now=time.time())) for i, k in enumerate(keys)],
                        time.time())
    os.unlink(blockfile.block_path(backend.ns_dir, keys[1]))  # another host evicted it
    statuses = [r.status for r in await backend.read(keys)]
    assert statuses == [Status.OK, Status.MISSING, Status.MISSING]
    await backend.close()


async def test_old_temp_files_go_young_ones_stay(tmp_path):
    backend = SharedDirBackend(str(tmp_path), NS, 1 << 30, fsync=False, lease_s=60)
    await backend.start()
    sub = Path(backend.ns_dir) / "ab"
    sub.mkdir()
    young, old = sub / f".x.1{blockfile.TMP_SUFFIX}", sub / f".y.2{blockfile.TMP_SUFFIX}"
    young.write_bytes(b"in progress"), old.write_bytes(b"killed writer")
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert await backend.sweep()
    assert young.exists() and not old.exists()
    await backend.close()


async def test_unreachable_share_is_a_store_fault(tmp_path):
    backend = SharedDirBackend(str(tmp_path / "share"), NS, 1 << 30, fsync=False)
    await backend.start()
    os.rename(tmp_path / "share", tmp_path / "gone")  # the mount went away
    with pytest.raises(OSError, match="not reachable"):
        await backend.ping()
    await backend.close()

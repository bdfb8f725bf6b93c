"""KVStore: lookup across tiers, spill on host eviction, promotion, write-through, stats."""
import os

import pytest

from duplex.kvstore.blockfile import HEADER_BYTES
from duplex.kvstore.store import KVStore
from kvstore_factories import DAY, make_entry, make_keys

N = 100
K = make_keys(6)


@pytest.fixture
async def store(disk_factory, clock):
    """Host RAM for two blocks in front of a disk tier."""
    kv = KVStore(2 * N, await disk_factory(), clock=clock)
    yield kv
    await kv.close()


async def test_lookup_reports_tiers_and_stops_at_the_first_miss(store):
    for i in (0, 1, 2, 4):
        store.put(K[i], make_entry(i, N))  # K0 spills to disk when K2 arrives, K1 when K4 does
    await store.flush()
    assert store.lookup(K) == ["disk", "disk", "host"]
    assert store.lookup([K[4], K[1]]) == ["host", "disk"]
    assert store.lookup([K[3], K[4]]) == []


async def test_host_eviction_spills_to_disk_once(store):
    for i in range(3):
        store.put(K[i], make_entry(i, N))
    await store.flush()
    assert store.host.keys() == [K[1], K[2]] and store.disk.keys() == [K[0]]
    assert os.path.getsize(store.disk.path(K[0])) == HEADER_BYTES + N
    store.put(K[0], make_entry(0, N))  # back into host: evicts K1 (spilled)
    store.put(K[3], make_entry(3, N))  # evicts K2 (spilled), not K0 again
    store.put(K[4], make_entry(4, N))  # evicts K0: already on disk, not rewritten
    await store.flush()
    assert sorted(store.disk.keys()) == sorted(K[:3])
    stats = store.stats()
    assert stats["spills"] == 3.0 and stats["disk_writes"] == 3.0
    assert stats["disk_dedup_skipped"] == 1.0


async def test_get_many_counts_tiers_and_promotes_disk_hits(store):
    for i in range(3):
        store.put(K[i], make_entry(i, N))
    await store.flush()
    entries = await store.get_many([K[0], K[2], K[5]])
    assert entries == [make_entry(0, N), make_entry(2, N), None]
    assert store.host.keys() == [K[2], K[0]]  # K0 promoted, K1 spilled for it
    stats = store.stats()
    assert (stats["hits_host"], stats["hits_disk"], stats["misses"]) == (1.0, 1.0, 1.0)


async def test_write_through_and_oversized_blocks_go_to_disk(store):
    store.put(K[0], make_entry(0, N), write_through=True)
    store.put(K[1], make_entry(1, 3 * N))  # bigger than the host tier
    await store.flush()
    assert store.host.keys() == [K[0]]
    assert sorted(store.disk.keys()) == sorted([K[0], K[1]])


async def test_corrupt_disk_block_is_a_counted_miss(store):
    for i in range(3):
        store.put(K[i], make_entry(i, N))
    await store.flush()
    with open(store.disk.path(K[0]), "r+b") as f:
        f.truncate(HEADER_BYTES + 1)
    assert await store.get_many([K[0]]) == [None]
    assert store.stats()["corrupt_dropped"] == 1.0 and store.lookup([K[0]]) == []


async def test_expired_blocks_are_gone_from_both_tiers(store, clock):
    for i in range(3):
        store.put(K[i], make_entry(i, N, cls="agent"))
    await store.flush()
    clock.advance(3.1 * DAY)
    assert store.lookup(K[:3]) == []
    assert await store.get_many(K[:3]) == [None, None, None]
    assert store.stats()["expirations"] == 3.0


async def test_stats_are_flat_floats(store):
    stats = store.stats()
    for name in ("hits_host", "hits_disk", "misses", "bytes_host", "bytes_disk",
                 "evictions_host", "evictions_disk", "expirations", "corrupt_dropped",
                 "write_errors", "spills", "disk_write_dropped", "disk_read_races"):
        assert stats[name] == 0.0
    assert all(isinstance(v, float) for v in stats.values())


async def test_host_only_and_disk_only_stores(disk_factory, clock):
    host_only = KVStore(2 * N, clock=clock)
    for i in range(3):
        host_only.put(K[i], make_entry(i, N))
    assert host_only.lookup(K[:3]) == [] and host_only.lookup(K[1:3]) == ["host", "host"]
    assert host_only.stats()["evictions_host"] == 1.0
    disk_only = KVStore(0, await disk_factory(), clock=clock)
    disk_only.put(K[0], make_entry(0, N))
    await disk_only.flush()
    assert disk_only.lookup(K[:1]) == ["disk"]
    assert await disk_only.get_many(K[:1]) == [make_entry(0, N)]

"""KVTiers (the store on its own thread) and BlockCodec (device block <-> entry), no model."""
from __future__ import annotations

import pytest
import torch

from engine.kv_tiers import BlockCodec, KVTiers
from kvstore import keys as kvkeys
from kvstore.disk import DiskConfig
from kvstore.entry import BlockEntry
from kvstore.errors import KVStoreError

NS = kvkeys.namespace("unit-model", "float32", 4)
KEYS = kvkeys.block_keys(NS, list(range(12)), 4)


def entry(fill: int, expires_at: float = 1e18) -> BlockEntry:
    return BlockEntry(bytes([fill]) * 64, "float32", (16,), 4, expires_at)


def disk_tiers(root, host_bytes=1 << 20) -> KVTiers:
    return KVTiers(host_bytes, DiskConfig(str(root), NS, 1 << 20, fsync=False))


def test_put_lookup_get_host_without_disk():
    tiers = KVTiers(1 << 20, None)
    tiers.put(KEYS[0], entry(1))
    tiers.put(KEYS[1], entry(2))
    assert tiers.lookup(KEYS) == ["host", "host"]
    assert tiers.get_host(KEYS[1]).payload == bytes([2]) * 64
    assert tiers.get_host_many([KEYS[2], KEYS[0]])[0] is None
    assert tiers.stats()["entries_host"] == 2
    tiers.close()
    tiers.close()  # idempotent


def test_write_behind_survives_restart_and_prefetch_promotes(tmp_path):
    tiers = disk_tiers(tmp_path)
    for i, key in enumerate(KEYS):
        tiers.write_behind(key, entry(i))
    assert tiers.get_host(KEYS[0]) is None, "write-behind skips host RAM"
    tiers.close()  # flushes the queued writes

    tiers = disk_tiers(tmp_path)
    assert tiers.lookup(KEYS) == ["disk"] * 3
    landed = {}
    found = tiers.prefetch(KEYS[:2], landed).result(timeout=30)
    assert [e.payload[0] for e in found] == [0, 1]
    assert landed == dict(zip(KEYS[:2], found))
    assert tiers.lookup(KEYS) == ["host", "host", "disk"]
    assert tiers.get_host(KEYS[1]).payload == bytes([1]) * 64
    tiers.close()


def test_clock_decides_expiry():
    now = [1000.0]
    tiers = KVTiers(1 << 20, None, clock=lambda: now[0])
    assert tiers.expiry("agent") == 1000.0 + 3 * 86400
    tiers.put(KEYS[0], entry(1, expires_at=tiers.expiry("agent")))
    now[0] += 3 * 86400
    assert tiers.lookup(KEYS) == []
    tiers.close()


def test_second_owner_of_a_dir_is_refused(tmp_path):
    tiers = disk_tiers(tmp_path)
    with pytest.raises(KVStoreError, match="in use"):
        disk_tiers(tmp_path)
    tiers.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_codec_copies_equal_the_per_block_ones(dtype):
    """The device path (one gather, one copy through a host buffer, one scatter), forced
    on the CPU, against one copy per block: the same bytes, entries that own them."""
    kv = torch.randn(3, 2, 6, 4, 2, 8).to(dtype)
    codec = BlockCodec(kv)
    ids, expiry = [4, 1, 3], [1.0, 2.0, 3.0]
    one_by_one = codec.save_many(ids, expiry, gather=False)
    batched = codec.save_many(ids, expiry, gather=True)
    for a, b in zip(one_by_one, batched):
        assert bytes(a.payload) == bytes(b.payload) and a.expires_at == b.expires_at
        assert b.payload.base is None, "an entry owns its bytes (the host tier budgets each)"
    kv[:, :, 4] = 0  # copies, not views of the pool
    fresh = bytes(codec.save(4, 0.0).payload)
    assert bytes(batched[0].payload) == bytes(one_by_one[0].payload) != fresh
    into = [0, 5, 2]
    reference = kv.clone()
    for block_id, entry in zip(into, one_by_one):
        codec.load(block_id, entry)
    expected, kv[:] = kv.clone(), reference
    codec.load_many(into, batched, gather=True)
    assert torch.equal(kv, expected)


@pytest.mark.gpu
def test_batched_codec_copies_on_cuda_equal_the_cpu_ones():
    """On CUDA, the default path batches (pinned buffer, one copy each way)."""
    from engine.platform import resolve

    host_kv = torch.randn(3, 2, 6, 4, 2, 8).to(torch.bfloat16)
    codec = BlockCodec(host_kv.cuda(), resolve("cuda"))
    entries = codec.save_many([4, 1, 3], [1.0, 2.0, 3.0])
    assert [bytes(e.payload) for e in entries] == \
        [bytes(e.payload) for e in BlockCodec(host_kv).save_many([4, 1, 3], [1.0] * 3)]
    codec.load_many([0, 5], entries[:2])
    assert torch.equal(codec.kv[:, :, [0, 5]].cpu(), host_kv[:, :, [4, 1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_round_trip_and_fit(dtype):
    kv = torch.randn(2, 2, 5, 4, 3, 8).to(dtype)  # [layers, k/v, blocks, slots, heads, dim]
    codec = BlockCodec(kv)
    saved = codec.save(3, expires_at=5.0)
    assert (saved.shape, saved.num_tokens, saved.expires_at) == ((2, 2, 4, 3, 8), 4, 5.0)
    kv[:, :, 3] = 0  # the entry is a copy, not a view of the pool
    codec.load(1, BlockEntry(bytes(saved.payload), saved.dtype, saved.shape, 4, 5.0))
    assert torch.equal(kv[:, :, 1], torch.frombuffer(bytearray(saved.payload), dtype=dtype)
                       .view(2, 2, 4, 3, 8))
    other = "float32" if dtype == torch.bfloat16 else "bfloat16"
    assert not codec.fits(BlockEntry(saved.payload, other, saved.shape, 4, 5.0))
    assert not codec.fits(BlockEntry(saved.payload, saved.dtype, (2, 2, 4, 6, 4), 4, 5.0))
    assert not codec.fits(BlockEntry(b"x" * 16, saved.dtype, saved.shape, 4, 5.0))

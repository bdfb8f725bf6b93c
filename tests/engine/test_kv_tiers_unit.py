"""KVTiers (the store on its own thread) and BlockCodec (device block <-> entry), no model."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from duplex.engine.kv_tiers import BlockCodec, BlockCopies, KVTiers
from duplex.kvstore import keys as kvkeys
from duplex.kvstore.disk import DiskConfig
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.errors import KVStoreError

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
    tiers.write_behind(KEYS, BlockCopies([entry(i) for i in range(len(KEYS))]))
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
    from duplex.engine.platform import resolve

    host_kv = torch.randn(3, 2, 6, 4, 2, 8).to(torch.bfloat16)
    codec = BlockCodec(host_kv.cuda(), resolve("cuda"))
    entries = codec.save_many([4, 1, 3], [1.0, 2.0, 3.0])
    assert [bytes(e.payload) for e in entries] == \
        [bytes(e.payload) for e in BlockCodec(host_kv).save_many([4, 1, 3], [1.0] * 3)]
    codec.load_many([0, 5], entries[:2])
    assert torch.equal(codec.kv[:, :, [0, 5]].cpu(), host_kv[:, :, [4, 1]])


class InFlight:
    """A HostCopy stand-in whose copy never reports done: the tiers must wait for it."""

    def is_done(self) -> bool:
        return False


def test_later_writes_wait_for_their_copies_on_the_tiers_thread(tmp_path):
    """put_copied / write_behind return before the copies they name are done, their
    keys miss until then, the copies are waited for on another thread, and close() stores
    them (a call that waited on the caller's thread would never return: the gate opens
    only after it)."""
    tiers, gate, waited_on = disk_tiers(tmp_path), threading.Event(), []

    def copied(*fills):
        def wait():
            waited_on.append(threading.current_thread())
            assert gate.wait(30), "the gate never opened"
            return [entry(f) for f in fills]
        return BlockCopies(wait, InFlight())

    tiers.write_behind(KEYS[:2], copied(1, 2))
    tiers.put_copied(KEYS[2:], copied(3))
    assert tiers.lookup(KEYS) == [] and tiers.get_host(KEYS[2]) is None
    gate.set()
    tiers.flush()
    assert tiers.get_host(KEYS[2]).payload == bytes([3]) * 64
    tiers.close()
    assert waited_on and threading.main_thread() not in waited_on
    tiers = disk_tiers(tmp_path)
    assert tiers.lookup(KEYS[:2]) == ["disk", "disk"]
    assert tiers.prefetch(KEYS[:2]).result(timeout=30)[1].payload == bytes([2]) * 64
    tiers.close()


def test_a_failed_copy_loses_only_its_own_writes(tmp_path, caplog):
    def broken():
        raise RuntimeError("device lost")

    tiers = disk_tiers(tmp_path)
    with caplog.at_level(logging.ERROR, logger="duplex.kv_tiers"):
        tiers.write_behind(KEYS[:1], BlockCopies(broken, InFlight()))
        tiers.write_behind(KEYS[1:2], BlockCopies(lambda: [entry(7)], InFlight()))
        tiers.close()  # neither hangs nor raises
    assert "1 blocks not stored" in caplog.text
    tiers = disk_tiers(tmp_path)
    assert tiers.lookup(KEYS[:1]) == [] and tiers.lookup(KEYS[1:2]) == ["disk"]
    tiers.close()


def test_later_codec_copies_equal_the_eager_ones():
    """save_many_later with the device path forced on the CPU: the same bytes as save_many;
    a CPU copy is done at once, so the tiers store it in call order."""
    kv = torch.randn(3, 2, 6, 4, 2, 8)
    codec = BlockCodec(kv)
    later = codec.save_many_later([5, 0], [1.0, 2.0], gather=True)
    eager = codec.save_many([5, 0], [1.0, 2.0], gather=False)
    assert later.ready and codec.save_many_later([5], [1.0]).ready
    assert [bytes(e.payload) for e in later()] == [bytes(e.payload) for e in eager]
    assert codec.save_many_later([], [])() == []


@pytest.mark.gpu
def test_later_codec_copies_on_cuda_do_not_wait_for_the_device():
    """On CUDA the gather and its copy are queued behind the work in flight, with no host
    wait (sync debug mode "error" would raise), and give the CPU codec's bytes."""
    from duplex.engine.platform import resolve

    host_kv = torch.randn(3, 2, 6, 4, 2, 8).to(torch.bfloat16)
    codec = BlockCodec(host_kv.cuda(), resolve("cuda"))
    torch.cuda._sleep(50_000_000)  # keeps the stream busy: a wait would have to block
    torch.cuda.set_sync_debug_mode("error")
    try:
        later = codec.save_many_later([4, 1], [1.0, 2.0])
        codec.load_many([0, 5], BlockCodec(host_kv).save_many([2, 3], [1.0, 1.0]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [bytes(e.payload) for e in later()] == \
        [bytes(e.payload) for e in BlockCodec(host_kv).save_many([4, 1], [1.0] * 2)]
    assert torch.equal(codec.kv[:, :, [0, 5]].cpu(), host_kv[:, :, [2, 3]])


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

"""DiskTier: round trip, restart, every fault a counted miss with the file gone, TTL, cap."""
import asyncio
import errno
import logging
import os
import shutil
import threading

import pytest

from duplex.kvstore import blockfile
from duplex.kvstore.blockfile import HEADER_BYTES
from duplex.kvstore.disk import DiskConfig, DiskTier
from duplex.kvstore.errors import KVStoreError
from duplex.kvstore.keys import key_hex, namespace
from kvstore_factories import DAY, NS, make_entry, make_keys

N = 256  # payload bytes per test block
FILE = HEADER_BYTES + N
K = make_keys(6)


async def stored(tier: DiskTier, num: int, **kw) -> list[bytes]:
    for i in range(num):
        assert tier.put(K[i], make_entry(i, N, **kw))
    await tier.flush()
    return K[:num]


def tree(tier: DiskTier) -> list[str]:
    """Every file under the tier's namespace dir (lock file aside), relative."""
    root = tier.config.ns_dir
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files if f != ".lock")


async def assert_dropped(tier: DiskTier, key: bytes, counter: str = "corrupt_dropped"):
    """The fault is a miss, counted once, and its file is gone."""
    assert await tier.get(key) is None
    await tier.flush()
    assert tier.stats()[counter] == 1
    assert not os.path.exists(tier.path(key))
    assert not tier.contains(key) and key not in tier.keys()


# ---------------------------------------------------------------- round trip, restart
async def test_round_trip_layout_and_accounting(disk_factory):
    tier = await disk_factory()
    keys = await stored(tier, 3)
    for i, key in enumerate(keys):
        assert await tier.get(key) == make_entry(i, N)
    assert tree(tier) == sorted(f"{key_hex(k)[:2]}/{key_hex(k)}" for k in keys)
    assert tier.path(keys[0]) == os.path.join(tier.config.root, NS.hex(),
                                              key_hex(keys[0])[:2], key_hex(keys[0]))
    assert os.path.getsize(tier.path(keys[0])) == FILE
    stats = tier.stats()
    assert (stats["writes"], stats["hits"], stats["bytes"], stats["entries"]) == (3, 3, 3 * FILE, 3)


async def test_queued_entries_are_served_before_they_are_written(disk_factory):
    tier = await disk_factory()
    assert tier.put(K[0], make_entry(0, N))
    assert tier.contains(K[0])
    assert await tier.get(K[0]) == make_entry(0, N)
    await tier.flush()
    assert tier.stats()["writes"] == 1 and tier.stats()["pending"] == 0


async def test_writes_are_deduplicated_by_key(disk_factory):
    tier = await disk_factory()
    assert tier.put(K[0], make_entry(0, N))
    assert not tier.put(K[0], make_entry(0, N))  # queued
    await tier.flush()
    assert not tier.put(K[0], make_entry(0, N))  # on disk
    await tier.flush()
    assert tier.stats()["writes"] == 1 and tier.stats()["dedup_skipped"] == 2


async def test_restart_rebuilds_the_index_and_lru_order(disk_factory):
    tier = await disk_factory()
    keys = await stored(tier, 4)
    assert await tier.get(keys[1]) is not None and await tier.get(keys[0]) is not None
    order = tier.keys()
    assert order == [keys[2], keys[3], keys[1], keys[0]]
    await tier.close()
    again = await disk_factory()
    assert again.keys() == order
    assert again.stats()["bytes"] == 4 * FILE and again.stats()["entries"] == 4
    for i, key in enumerate(keys):
        assert await again.get(key) == make_entry(i, N)


async def test_close_drains_queued_writes(disk_factory):
    tier = await disk_factory()
    for i in range(3):
        tier.put(K[i], make_entry(i, N))
    await tier.close()
    assert not tier.put(K[4], make_entry(4, N))  # closed: dropped, counted
    assert tier.stats()["write_dropped"] == 1
    again = await disk_factory()
    assert [await again.get(k) for k in K[:3]] == [make_entry(i, N) for i in range(3)]


async def test_pending_queue_is_bounded(disk_factory):
    tier = await disk_factory(max_pending_bytes=2 * N)
    assert tier.put(K[0], make_entry(0, N)) and tier.put(K[1], make_entry(1, N))
    assert not tier.put(K[2], make_entry(2, N))
    assert tier.stats()["write_dropped"] == 1


# ---------------------------------------------------------------- damaged files
@pytest.mark.parametrize("length", [0, 10, HEADER_BYTES - 1, HEADER_BYTES, FILE - 1])
async def test_truncated_file_is_a_miss(disk_factory, length):
    tier = await disk_factory()
    keys = await stored(tier, 2)
    os.truncate(tier.path(keys[0]), length)
    await assert_dropped(tier, keys[0])
    assert await tier.get(keys[1]) == make_entry(1, N)


async def test_file_with_extra_bytes_is_a_miss(disk_factory):
    tier = await disk_factory()
    keys = await stored(tier, 1)
    with open(tier.path(keys[0]), "ab") as f:
        f.write(b"\0")
    await assert_dropped(tier, keys[0])


@pytest.mark.parametrize("offset", [HEADER_BYTES, HEADER_BYTES + N // 2, FILE - 1])
async def test_flipped_payload_byte_is_a_miss(disk_factory, offset, caplog):
    tier = await disk_factory()
    keys = await stored(tier, 1)
    flip(tier.path(keys[0]), offset)
    with caplog.at_level(logging.WARNING, logger="duplex.kvstore.disk"):
        await assert_dropped(tier, keys[0])
    assert "checksum mismatch" in caplog.text and tier.path(keys[0]) in caplog.text


async def test_every_flipped_header_byte_is_a_miss(disk_factory):
    tier = await disk_factory(fsync=False)  # 192 files; durability is not what is tested
    keys = make_keys(HEADER_BYTES, salt=7)
    for i, key in enumerate(keys):
        assert tier.put(key, make_entry(i, N))
    await tier.flush()
    for offset, key in enumerate(keys):  # file i gets header byte i flipped
        flip(tier.path(key), offset)
    for offset, key in enumerate(keys):
        assert await tier.get(key) is None, f"header byte {offset}"
    await tier.flush()
    assert tree(tier) == []
    assert tier.stats()["corrupt_dropped"] == HEADER_BYTES
    assert tier.stats()["hits"] == 0 and tier.stats()["entries"] == 0


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


# ---------------------------------------------------------------- foreign files
@pytest.mark.parametrize("other_ns", [
    namespace("other-model", "float16", 4, "L2-K-V"),
    namespace("test-model", "bfloat16", 4, "L2-K-V"),
    namespace("test-model", "float16", 8, "L2-K-V"),
    namespace("test-model", "float16", 4, "L1")],
    ids=["model", "dtype", "block_size", "layout"])
async def test_file_of_another_namespace_at_the_keys_path_is_a_miss(disk_factory, tmp_path,
                                                                   other_ns, caplog):
    tier = await disk_factory()
    keys = await stored(tier, 1)
    other = await disk_factory(ns=other_ns, root=tmp_path / "other")
    other_key = make_keys(1, ns=other_ns)[0]
    other.put(other_key, make_entry(0, N))
    await other.flush()
    shutil.copyfile(other.path(other_key), tier.path(keys[0]))
    with caplog.at_level(logging.WARNING, logger="duplex.kvstore.disk"):
        await assert_dropped(tier, keys[0])
    assert "foreign namespace" in caplog.text


async def test_file_of_another_key_is_a_miss(disk_factory):
    tier = await disk_factory()
    keys = await stored(tier, 2)
    shutil.copyfile(tier.path(keys[1]), tier.path(keys[0]))
    await assert_dropped(tier, keys[0])
    assert await tier.get(keys[1]) == make_entry(1, N)


async def test_file_of_another_layout_version_is_a_miss(disk_factory):
    tier = await disk_factory()
    keys = await stored(tier, 1)
    entry = make_entry(0, N)
    header = blockfile.encode_header(NS, keys[0], entry, layout_version=2)  # valid CRC
    with open(tier.path(keys[0]), "wb") as f:
        f.write(header + entry.payload)
    await assert_dropped(tier, keys[0])


async def test_foreign_file_found_by_a_restart_is_a_miss(disk_factory):
    tier = await disk_factory()
    keys = await stored(tier, 2)
    await tier.close()
    shutil.copyfile(tier.path(keys[1]), tier.path(keys[0]))
    again = await disk_factory()
    assert again.contains(keys[0])  # the index is rebuilt from names and sizes only
    await assert_dropped(again, keys[0])


# ---------------------------------------------------------------- killed writer, races, full disk
async def test_leftover_temp_files_are_removed_at_start(disk_factory):
    tier = await disk_factory()
    keys = await stored(tier, 1)
    await tier.close()
    subdir = os.path.dirname(tier.path(K[3]))
    os.makedirs(subdir, exist_ok=True)
    leftover = os.path.join(subdir, f".{key_hex(K[3])}.dead{blockfile.TMP_SUFFIX}")
    with open(leftover, "wb") as f:
        f.write(b"half a block")
    again = await disk_factory()
    assert not os.path.exists(leftover)
    assert again.stats()["temp_removed"] == 1 and again.keys() == keys
    assert await again.get(K[3]) is None


@pytest.mark.parametrize("read_first", [True, False])
async def test_read_racing_an_eviction_is_a_miss(disk_factory, monkeypatch, read_first):
    tier = await disk_factory()
    keys = await stored(tier, 2)
    evict_all = lambda: tier.evict(tier.config.capacity_bytes)  # noqa: E731
    release = await hold_reads(monkeypatch, read_first, evict_all)
    task = asyncio.create_task(tier.get(keys[0]))
    await release(tier)
    assert await task is None
    assert not os.path.exists(tier.path(keys[0]))
    assert tier.stats()["read_races"] == 1 and tier.stats()["evictions"] == 2


async def test_read_racing_a_sweep_is_a_miss(disk_factory, monkeypatch, clock):
    tier = await disk_factory()
    keys = await stored(tier, 1, cls="agent")
    clock.advance(2 * DAY)
    async def sweep_at_3_days():
        clock.advance(2 * DAY)
        assert await tier.sweep() == 1
    release = await hold_reads(monkeypatch, True, sweep_at_3_days)
    task = asyncio.create_task(tier.get(keys[0]))
    await release(tier)
    assert await task is None
    assert not os.path.exists(tier.path(keys[0]))
    assert tier.stats()["read_races"] == 1 and tier.stats()["expirations"] == 1


async def hold_reads(monkeypatch, read_first: bool, meddle):
    """Make block reads wait (after or before reading the file) until `meddle` has run."""
    started, go = threading.Event(), threading.Event()
    real = blockfile.read_block

    def held(*args):
        result = real(*args) if read_first else None
        started.set()
        go.wait(10)
        return result if read_first else real(*args)

    monkeypatch.setattr(blockfile, "read_block", held)

    async def release(tier):
        assert await asyncio.to_thread(started.wait, 10)
        outcome = meddle()
        if asyncio.iscoroutine(outcome):
            await outcome
        await tier.flush()  # the removal runs on another I/O thread
        go.set()
    return release


@pytest.mark.parametrize("partial", [False, True])
async def test_full_disk_is_counted_and_nothing_stored(disk_factory, monkeypatch, partial, caplog):
    tier = await disk_factory()

    def no_space(fd, chunks):
        if partial:
            os.write(fd, b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(blockfile, "_write_chunks", no_space)
    with caplog.at_level(logging.WARNING, logger="duplex.kvstore.disk"):
        assert tier.put(K[0], make_entry(0, N))
        await tier.flush()
    assert tier.stats()["write_errors"] == 1 and tier.stats()["entries"] == 0
    assert tree(tier) == [] and "No space left" in caplog.text
    assert await tier.get(K[0]) is None
    monkeypatch.undo()
    assert tier.put(K[0], make_entry(0, N))  # not stored, so a later put may retry
    await tier.flush()
    assert await tier.get(K[0]) == make_entry(0, N)


async def test_uncreatable_root_fails_at_start_with_path_and_reason(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tier = DiskTier(DiskConfig(str(blocker / "kv"), NS, 1 << 20))
    with pytest.raises(KVStoreError) as info:
        await tier.start()
    assert str(blocker / "kv") in str(info.value) and "Not a directory" in str(info.value)
    assert await tier.get(K[0]) is None


async def test_one_tier_per_namespace_dir(disk_factory):
    await disk_factory()
    with pytest.raises(KVStoreError, match="in use"):
        await disk_factory()


# ---------------------------------------------------------------- TTL
async def test_chat_entry_lives_7_days_agent_3(disk_factory, clock):
    tier = await disk_factory()
    chat, agent = K[0], K[1]
    tier.put(chat, make_entry(0, N, cls="chat"))
    tier.put(agent, make_entry(1, N, cls="agent"))
    await tier.flush()
    clock.advance(2.9 * DAY)
    assert await tier.get(agent) == make_entry(1, N, cls="agent")
    clock.advance(0.2 * DAY)  # 3.1 days
    assert not tier.contains(agent) and await tier.get(agent) is None
    clock.advance(3.8 * DAY)  # 6.9 days
    assert await tier.get(chat) == make_entry(0, N, cls="chat")
    clock.advance(0.2 * DAY)  # 7.1 days
    assert await tier.get(chat) is None
    await tier.flush()
    assert tree(tier) == [] and tier.stats()["expirations"] == 2


async def test_sweep_deletes_expired_files(disk_factory, clock):
    tier = await disk_factory()
    tier.put(K[0], make_entry(0, N, cls="chat"))
    tier.put(K[1], make_entry(1, N, cls="agent"))
    await tier.flush()
    clock.advance(3.1 * DAY)
    assert await tier.sweep() == 1
    await tier.flush()
    assert tier.keys() == [K[0]] and tree(tier) == [f"{key_hex(K[0])[:2]}/{key_hex(K[0])}"]
    clock.advance(4 * DAY)
    assert await tier.sweep() == 1
    await tier.flush()
    assert tree(tier) == [] and tier.stats()["bytes"] == 0


async def test_sweep_after_restart_learns_expiries_from_headers(disk_factory, clock):
    tier = await disk_factory()
    await stored(tier, 2, cls="agent")
    await tier.close()
    clock.advance(3.1 * DAY)
    again = await disk_factory()
    assert again.contains(K[0])  # expiry unknown until a header is read
    assert await again.sweep() == 2
    await again.flush()
    assert tree(again) == [] and again.stats()["expirations"] == 2


async def test_expired_entries_are_not_written(disk_factory, clock):
    tier = await disk_factory()
    assert not tier.put(K[0], make_entry(0, N, now=clock.now - 8 * DAY))
    assert tier.stats()["rejected"] == 1


# ---------------------------------------------------------------- capacity
async def test_capacity_evicts_least_recently_used(disk_factory):
    tier = await disk_factory(capacity_bytes=3 * FILE)
    keys = await stored(tier, 3)
    assert await tier.get(keys[0]) is not None  # LRU order: 1, 2, 0
    tier.put(K[3], make_entry(3, N))
    await tier.flush()
    assert tier.keys() == [keys[2], keys[0], K[3]]
    assert not os.path.exists(tier.path(keys[1])) and len(tree(tier)) == 3
    assert tier.stats()["evictions"] == 1 and tier.stats()["bytes"] == 3 * FILE
    assert await tier.get(keys[1]) is None


async def test_block_bigger_than_the_cap_is_not_stored(disk_factory):
    tier = await disk_factory(capacity_bytes=FILE - 1)
    tier.put(K[0], make_entry(0, N))
    await tier.flush()
    assert tier.stats()["rejected"] == 1 and tree(tier) == []


async def test_explicit_evict(disk_factory):
    tier = await disk_factory(capacity_bytes=4 * FILE)
    keys = await stored(tier, 4)
    assert tier.evict(2 * FILE) == 2
    await tier.flush()
    assert tier.keys() == keys[2:] and len(tree(tier)) == 2

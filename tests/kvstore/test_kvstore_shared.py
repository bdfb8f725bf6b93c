"""The fleet-shared KV tier on both backends (a real redis-server, a shared directory):
round trips, chains, damaged and foreign values, racing writers, a store that is down,
killed and restarted, full (maxmemory), or slow, and native expiry."""
from __future__ import annotations

import asyncio
import os
import time

import pytest
import redis.asyncio as aioredis

from duplex.kvstore import blockfile, retention
from duplex.kvstore.keys import namespace
from duplex.kvstore.redis_tier import RedisBackend
from duplex.kvstore.shared import SharedConfig, SharedTier, open_shared
from kvstore_factories import NS, make_entry, make_keys

FAST = SharedConfig(op_timeout_s=0.3, max_failures=1, cooldown_s=0.2)
OTHER_MODEL = namespace("other-model", "float16", 4, "L2-K-V")


def now_entry(seed: int, nbytes: int = 256, cls: str = retention.CHAT):
    return make_entry(seed, nbytes, cls=cls, now=time.time())


@pytest.fixture(params=["redis", "dir"])
def shared_url(request, tmp_path):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{server.port}/{1 + len(os.listdir(tmp_path)) % 15}"
    return str(tmp_path / "shared")


@pytest.fixture
async def tiers():
    started: list[SharedTier] = []

    async def make(url: str, ns: bytes = NS, config: SharedConfig = FAST, **kw) -> SharedTier:
        tier = open_shared(url, ns, kw.pop("capacity_bytes", 1 << 30), config)
        await tier.start()
        started.append(tier)
        return tier
    yield make
    for tier in started:
        await tier.close()


async def flush_db(url: str) -> None:
    if url.startswith("redis"):
        client = aioredis.Redis.from_url(url)
        await client.flushdb()
        await client.aclose()


async def test_round_trip_and_chain_stops_at_first_miss(tiers, shared_url):
    await flush_db(shared_url)
    writer, reader = await tiers(shared_url), await tiers(shared_url)  # two workers
    keys = make_keys(4, salt=1)
    entries = [now_entry(i) for i in range(4)]
    for i in (0, 1, 3):  # block 2 missing
        assert writer.put(keys[i], entries[i])
    await writer.flush()
    got = await reader.get_chain(keys)
    assert [bytes(e.payload) if e else None for e in got] == \
        [entries[0].payload, entries[1].payload, None, None]
    stats = reader.stats()
    assert (stats["hits"], stats["misses"], stats["on"]) == (2, 2, 1)
    assert stats["bytes_read"] == 512 and stats["read_p50_ms"] > 0
    if shared_url.startswith("redis"):
        assert stats["store_bytes"] > 0, "the server's used_memory, asked for at start"


async def test_damaged_and_foreign_values_are_never_served(tiers, shared_url, tmp_path):
    await flush_db(shared_url)
    tier = await tiers(shared_url)
    keys = make_keys(5, salt=2)
    foreign_keys = make_keys(1, salt=3)  # another tenant's (or prompt's) key
    for key in keys + foreign_keys:
        tier.put(key, now_entry(7))
    await tier.flush()
    good = blockfile.encode_block(NS, keys[0], now_entry(7))
    other_model = blockfile.encode_block(OTHER_MODEL, keys[3], now_entry(7))
    flipped = bytearray(good)
    flipped[-10] ^= 0x01
    damage = {keys[1]: good[:-5],  # truncated
              keys[2]: bytes(flipped),  # one bit flipped (its key field is keys[0]'s, too)
              keys[3]: other_model,  # another model's value under this key
              keys[4]: blockfile.encode_block(NS, foreign_keys[0], now_entry(7))}
    for key, value in damage.items():
        await _overwrite(shared_url, tier, key, value)
    for key in damage:
        assert await tier.get_chain([key]) == [None], key.hex()
    assert tier.stats()["corrupt_dropped"] == 4
    assert (await tier.get_chain([foreign_keys[0]]))[0] is not None


async def _overwrite(url: str, tier: SharedTier, key: bytes, value: bytes) -> None:
    if url.startswith("redis"):
        client = aioredis.Redis.from_url(url)
        await client.set(tier.backend.name(key), value)
        await client.aclose()
    else:
        path = blockfile.block_path(tier.backend.ns_dir, key)
        with open(path, "wb") as f:
            f.write(value)


async def test_two_writers_racing_on_one_key(tiers, shared_url):
    await flush_db(shared_url)
    a, b = await tiers(shared_url), await tiers(shared_url)
    key, = make_keys(1, salt=4)
    ea, eb = now_entry(10, 4096), now_entry(11, 4096)
    for _ in range(5):
        a.put(key, ea), b.put(key, eb)
        await asyncio.gather(a.flush(), b.flush())
        a.forget_known(), b.forget_known()
    got, = await (await tiers(shared_url)).get_chain([key])
    assert bytes(got.payload) in (ea.payload, eb.payload)
    assert a.stats()["write_errors"] == b.stats()["write_errors"] == 0


async def test_store_down_at_start_then_up(tiers, redis_factory):
    server = redis_factory(started=False)  # not started: nothing listens on its port
    tier = await tiers(f"redis://127.0.0.1:{server.port}/0")
    key, = make_keys(1, salt=5)
    assert tier.stats()["on"] == 0
    start = time.perf_counter()
    assert await tier.get_chain([key]) == [None]
    assert time.perf_counter() - start < 0.05, "an off tier answers at once"
    assert not tier.put(key, now_entry(1))
    server.start()
    await _until(lambda: tier.is_on, 3.0)
    assert tier.put(key, now_entry(1))
    await tier.flush()
    assert (await tier.get_chain([key]))[0] is not None


async def test_store_killed_mid_run_and_restarted(tiers, redis_factory):
    server = redis_factory()
    tier = await tiers(server.url)
    keys = make_keys(3, salt=6)
    tier.put(keys[0], now_entry(1))
    await tier.flush()
    assert (await tier.get_chain(keys[:1]))[0] is not None
    server.kill()
    assert await tier.get_chain(keys[:1]) == [None], "a dead store is a miss, not an error"
    assert tier.stats()["on"] == 0 and tier.stats()["breaker_trips"] == 1
    tier.put(keys[1], now_entry(2))  # dropped while off
    server.start()  # same port, empty (no persistence)
    await _until(lambda: tier.is_on, 3.0)
    assert tier.put(keys[0], now_entry(1)), "the tier forgot what the dead store held"
    await tier.flush()
    assert (await tier.get_chain(keys[:1]))[0] is not None


async def test_maxmemory_evicts_without_client_errors(tiers, redis_factory):
    server = redis_factory("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    tier = await tiers(server.url, config=SharedConfig(op_timeout_s=2.0))
    keys = make_keys(60, salt=7)
    for i, key in enumerate(keys):  # 60 x 64 KiB: 3.8 MiB into 2 MiB
        tier.put(key, now_entry(i, 65536))
        await tier.flush()
    stats = tier.stats()
    assert stats["write_errors"] == stats["write_rejected"] == 0 and stats["on"] == 1
    assert b"evicted_keys:0\r" not in server.command("INFO", "stats")
    assert (await tier.get_chain(keys[-1:]))[0] is not None, "recent blocks stay"


async def test_maxmemory_noeviction_refuses_writes_quietly(tiers, redis_factory):
    server = redis_factory("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    tier = await tiers(server.url, config=SharedConfig(op_timeout_s=2.0))
    for i, key in enumerate(make_keys(40, salt=8)):
        tier.put(key, now_entry(i, 65536))
        await tier.flush()
    stats = tier.stats()
    assert stats["write_rejected"] > 0 and stats["on"] == 1 and stats["write_errors"] == 0


async def test_expiry_is_the_stores_own(tiers, redis_server):
    url = f"redis://127.0.0.1:{redis_server.port}/15"
    tier = await tiers(url)
    chat, agent = make_keys(2, salt=9)
    tier.put(chat, now_entry(1, cls=retention.CHAT))
    tier.put(agent, now_entry(2, cls=retention.AGENT))
    await tier.flush()
    client = aioredis.Redis.from_url(url)
    ttl_days = [await client.pttl(tier.backend.name(k)) / 86_400_000 for k in (chat, agent)]
    await client.aclose()
    assert 6.99 < ttl_days[0] <= 7 and 2.99 < ttl_days[1] <= 3


class SlowBackend:
    """Wraps a backend, adding `delay_s` to every call (a slow store)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s, self.kind = inner, delay_s, inner.kind

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if not asyncio.iscoroutinefunction(method):
            return method

        async def slow(*args):
            await asyncio.sleep(self.delay_s)
            return await method(*args)
        return slow


async def test_slow_store_costs_at_most_the_timeout(redis_server):
    backend = SlowBackend(RedisBackend(redis_server.url, NS), delay_s=2.0)
    tier = SharedTier(backend, SharedConfig(op_timeout_s=0.2, max_failures=2, cooldown_s=60))
    await tier.start()  # start itself times out (4 x op_timeout): tier off, no exception
    assert not tier.is_on
    tier.breaker.record_success()  # pretend it answered once: now every call is slow
    key, = make_keys(1, salt=10)
    start = time.perf_counter()
    assert await tier.get_chain([key]) == [None]
    assert await tier.get_chain([key]) == [None]
    assert time.perf_counter() - start < 0.6, "two reads, each cut at op_timeout_s"
    assert not tier.is_on, "two slow calls in a row turn the tier off"
    start = time.perf_counter()
    assert await tier.get_chain([key]) == [None]
    assert time.perf_counter() - start < 0.01
    backend.delay_s = 0.0
    await tier.close()


async def test_inflight_bytes_are_bounded(redis_server):
    backend = SlowBackend(RedisBackend(redis_server.url, NS), delay_s=0.05)
    tier = SharedTier(backend, SharedConfig(max_inflight_bytes=10_000))
    await tier.start()
    accepted = [tier.put(k, now_entry(i, 4096)) for i, k in enumerate(make_keys(5, salt=11))]
    assert accepted == [True, True, False, False, False]
    assert tier.stats()["write_dropped"] == 3 and tier.stats()["inflight_bytes"] == 8192
    await tier.close()


async def _until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_long_chain_is_read_in_batches_and_stops_at_the_first_gap(tiers, shared_url):
    await flush_db(shared_url)
    tier = await tiers(shared_url)
    keys = make_keys(40, salt=12)
    for i, key in enumerate(keys):
        if i != 35:
            tier.put(key, now_entry(i, 64))
    await tier.flush()
    got = await tier.get_chain(keys)
    assert [e is not None for e in got] == [True] * 35 + [False] * 5
    assert tier.stats()["reads"] == 3  # 16 + 16 + 8: the third round trip finds the gap


def test_breaker_opens_after_failures_and_lets_one_trial_through():
    from duplex.kvstore.breaker import CircuitBreaker
    now = [0.0]
    breaker = CircuitBreaker(max_failures=2, cooldown_s=5.0, clock=lambda: now[0])
    breaker.record_failure()
    assert breaker.is_on and breaker.allow()
    breaker.record_failure()
    assert not breaker.is_on and not breaker.allow() and breaker.num_trips == 1
    now[0] = 5.0
    assert breaker.allow() and not breaker.allow(), "one trial at a time"
    breaker.record_failure()  # the trial failed: off for another cooldown
    assert not breaker.allow() and breaker.num_trips == 1
    now[0] = 10.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.is_on and breaker.allow()


async def test_redis_cluster_round_trip_across_slots(tiers, tmp_path):
    from tests.redis_server import RedisCluster
    cluster = RedisCluster(tmp_path).start()
    try:
        tier = await tiers(cluster.url, config=SharedConfig(op_timeout_s=2.0))
        keys = make_keys(20, salt=13)  # spread over the three nodes' hash slots
        entries = [now_entry(i, 128) for i in range(20)]
        for key, entry in zip(keys, entries):
            tier.put(key, entry)
        await tier.flush()
        got = await tier.get_chain(keys)
        assert [bytes(e.payload) for e in got] == [e.payload for e in entries]
        assert tier.stats()["write_errors"] == tier.stats()["write_rejected"] == 0
        counts = [int(n.command("DBSIZE").split(b":")[1]) for n in cluster.nodes]
        assert sum(counts) == 20 and all(counts), counts
    finally:
        cluster.kill()


def test_store_urls():
    from duplex.kvstore.redis_tier import plain_url
    assert plain_url("redis+cluster://h:7000") == ("redis://h:7000", True)
    assert plain_url("valkeys://:pw@h:6380/2") == ("rediss://:pw@h:6380/2", False)
    assert plain_url("redis://h:6379/0") == ("redis://h:6379/0", False)
    with pytest.raises(ValueError, match="--kv-remote must be"):
        open_shared("memcached://h", NS, 1)


async def test_close_ends_the_writer_even_when_a_cancellation_is_lost(tmp_path, monkeypatch):
    """Python 3.11's `asyncio.wait_for` returns the inner result, dropping the cancellation,
    when the cancel lands just as the inner await completes; CI once hung 900 s on it in
    `close`. Lose every cancellation on purpose: close must still end the writer."""
    real_wait_for = asyncio.wait_for

    async def losing_wait_for(aw, timeout):
        try:
            return await real_wait_for(aw, timeout)
        except asyncio.CancelledError:
            return None

    monkeypatch.setattr(asyncio, "wait_for", losing_wait_for)
    tier = open_shared(str(tmp_path / "shared"), NS, 1 << 30, FAST)
    await tier.start()
    key, = make_keys(1, salt=9)
    assert tier.put(key, now_entry(1))
    await tier.flush()
    closing = asyncio.ensure_future(tier.close())
    done, _ = await asyncio.wait([closing], timeout=2.0)
    if not done:  # let the writer go, so that the failure is reported rather than a hang
        monkeypatch.undo()
        for _ in range(3):
            tier._task.cancel()
            await asyncio.sleep(FAST.cooldown_s)
    assert done and tier._task.done(), "close() hung on a writer that lost its cancellation"

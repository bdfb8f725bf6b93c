"""HostTier: exact LRU order, byte bound, expiry, eviction hook."""
import pytest

from kvstore_factories import DAY, make_entry, make_keys
from duplex.kvstore.host import HostTier

K = make_keys(8)


def filled(capacity: int, num: int, clock, **kw) -> HostTier:
    host = HostTier(capacity, clock=clock, **kw)
    for i in range(num):
        assert host.put(K[i], make_entry(i, 100))
    return host


def test_put_get_round_trip(clock):
    host = filled(1000, 3, clock)
    assert host.get(K[1]) == make_entry(1, 100)
    assert host.get(K[5]) is None
    assert host.stats() == {"hits": 1, "misses": 1, "puts": 3, "rejected": 0, "evictions": 0,
                            "expirations": 0, "bytes": 300, "entries": 3,
                            "capacity_bytes": 1000}


def test_lru_order_and_byte_bound_exact(clock):
    evicted = []
    host = filled(300, 3, clock, on_evict=lambda k, e: evicted.append((k, e)))
    assert host.get(K[0]) is not None  # order now 1, 2, 0
    assert host.keys() == [K[1], K[2], K[0]]
    assert host.put(K[3], make_entry(3, 150))  # needs 150 free: evicts 1 and 2
    assert evicted == [(K[1], make_entry(1, 100)), (K[2], make_entry(2, 100))]
    assert host.keys() == [K[0], K[3]]
    assert host.bytes_used == 250 and len(host) == 2
    assert host.stats()["evictions"] == 2


def test_contains_does_not_touch_lru(clock):
    host = filled(300, 3, clock)
    assert host.contains(K[0]) and not host.contains(K[7])
    assert host.keys() == [K[0], K[1], K[2]]


def test_replacing_a_key_updates_bytes_and_recency(clock):
    host = filled(1000, 3, clock)
    assert host.put(K[0], make_entry(9, 40))
    assert host.keys() == [K[1], K[2], K[0]] and host.bytes_used == 240
    assert host.get(K[0]) == make_entry(9, 40)


def test_too_big_or_expired_is_rejected(clock):
    host = filled(300, 1, clock)
    assert not host.put(K[5], make_entry(5, 301))
    assert not host.put(K[5], make_entry(5, 10, now=clock.now - 8 * DAY))
    assert host.keys() == [K[0]] and host.stats()["rejected"] == 2


def test_expired_entries_are_never_returned(clock):
    host = filled(1000, 2, clock)
    host.put(K[2], make_entry(2, 100, cls="agent"))
    clock.advance(3.1 * DAY)
    assert not host.contains(K[2])
    assert host.get(K[2]) is None and host.pop(K[2]) is None
    assert host.get(K[0]) is not None  # chat: 7 days
    clock.advance(4 * DAY)
    assert host.sweep() == 2 and len(host) == 0 and host.bytes_used == 0
    assert host.stats()["expirations"] == 3


def test_expired_lru_victims_are_not_handed_to_on_evict(clock):
    evicted = []
    host = HostTier(200, clock=clock, on_evict=lambda k, e: evicted.append(k))
    host.put(K[0], make_entry(0, 100, cls="agent"))
    host.put(K[1], make_entry(1, 100))
    clock.advance(4 * DAY)
    host.put(K[2], make_entry(2, 200))
    assert evicted == [K[1]]
    assert host.stats()["expirations"] == 1 and host.stats()["evictions"] == 1


def test_pop_and_explicit_evict(clock):
    host = filled(1000, 4, clock)
    assert host.pop(K[1]) == make_entry(1, 100) and host.pop(K[1]) is None
    assert host.evict(900) == 2  # free 700 -> evict K0, K2
    assert host.keys() == [K[3]] and host.bytes_used == 100
    assert host.evict(0) == 0


def test_negative_capacity_rejected(clock):
    with pytest.raises(ValueError):
        HostTier(-1, clock=clock)

"""Property-based: HostTier and DiskTier against an ordered-dict model of LRU + TTL.

The model is the whole specification in a few lines: entries in last-access order, a byte
cap filled by evicting from the front, expired entries never served. The disk machine also
restarts the tier (the index is rebuilt from the files) and checks the files themselves.
"""
import asyncio
import os
import shutil
import tempfile
from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from duplex.kvstore.blockfile import HEADER_BYTES
from duplex.kvstore.disk import DiskConfig, DiskTier
from duplex.kvstore.host import HostTier
from kvstore_factories import DAY, FakeClock, make_entry, make_keys

KEYS = make_keys(6)
key_index = st.integers(0, len(KEYS) - 1)
sizes = st.sampled_from([0, 64, 200, 320])
classes = st.sampled_from(["chat", "agent"])
days = st.sampled_from([0.5, 1.0, 2.5, 4.0])


class LruModel:
    """Reference: OrderedDict key -> (entry, bytes), oldest access first."""

    def __init__(self, capacity: int, overhead: int, clock: FakeClock) -> None:
        self.capacity, self.overhead, self.clock = capacity, overhead, clock
        self.entries: OrderedDict = OrderedDict()

    def used(self) -> int:
        return sum(self.size(e) for e in self.entries.values())

    def size(self, entry) -> int:
        return self.overhead + entry.nbytes

    def live(self, key):
        entry = self.entries.get(key)
        if entry is not None and entry.is_expired(self.clock()):
            del self.entries[key]
            return None
        return entry

    def evict(self, num_bytes: int) -> int:
        """Pop from the front until num_bytes are free; how many unexpired went."""
        num_evicted = 0
        while self.entries and self.capacity - self.used() < num_bytes:
            _, entry = self.entries.popitem(last=False)
            num_evicted += not entry.is_expired(self.clock())
        return num_evicted

    def insert(self, key, entry) -> None:
        self.entries.pop(key, None)
        if self.size(entry) <= self.capacity:
            self.evict(self.size(entry))
            self.entries[key] = entry

    def get(self, key):
        entry = self.live(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def sweep(self) -> int:
        expired = [k for k, e in self.entries.items() if e.is_expired(self.clock())]
        for key in expired:
            del self.entries[key]
        return len(expired)


class HostMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.host = HostTier(700, clock=self.clock)
        self.model = LruModel(700, 0, self.clock)
        self.seed = 0

    @rule(i=key_index, size=sizes, cls=classes)
    def put(self, i, size, cls):
        self.seed += 1
        entry = make_entry(self.seed, size, cls=cls, now=self.clock.now)
        assert self.host.put(KEYS[i], entry) == (size <= 700)
        self.model.insert(KEYS[i], entry)

    @rule(i=key_index)
    def get(self, i):
        assert self.host.get(KEYS[i]) == self.model.get(KEYS[i])

    @rule(i=key_index)
    def pop(self, i):
        assert self.host.pop(KEYS[i]) == self.model.live(KEYS[i])
        self.model.entries.pop(KEYS[i], None)

    @rule(num_bytes=st.integers(0, 800))
    def evict(self, num_bytes):
        assert self.host.evict(num_bytes) == self.model.evict(num_bytes)

    @rule(d=days)
    def advance_clock(self, d):
        self.clock.advance(d * DAY)

    @rule()
    def sweep(self):
        assert self.host.sweep() == self.model.sweep()

    @invariant()
    def matches_model(self):
        assert self.host.keys() == list(self.model.entries)
        assert self.host.bytes_used == self.model.used() <= 700
        for key in KEYS:
            assert self.host.contains(key) == (self.model.entries.get(key) is not None and
                                               not self.model.entries[key].is_expired(self.clock()))


class DiskMachine(RuleBasedStateMachine):
    """Each rule runs to completion (flush) on the machine's own event loop."""
    CAPACITY = 3 * (HEADER_BYTES + 200)

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root = tempfile.mkdtemp(prefix="kvstore-machine-")
        self.clock = FakeClock()
        self.model = LruModel(self.CAPACITY, HEADER_BYTES, self.clock)
        self.tier = self.run(self.open_tier())
        self.seed = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def open_tier(self) -> DiskTier:
        from kvstore_factories import NS
        tier = DiskTier(DiskConfig(self.root, NS, self.CAPACITY, fsync=False), clock=self.clock)
        await tier.start()
        return tier

    def teardown(self):
        self.run(self.tier.close())
        self.loop.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(i=key_index, size=sizes, cls=classes)
    def put(self, i, size, cls):
        self.seed += 1
        key, entry = KEYS[i], make_entry(self.seed, size, cls=cls, now=self.clock.now)
        is_new = self.model.live(key) is None
        assert self.tier.put(key, entry) == is_new
        if is_new:
            self.model.insert(key, entry)
        self.run(self.tier.flush())

    @rule(i=key_index)
    def get(self, i):
        assert self.run(self.tier.get(KEYS[i])) == self.model.get(KEYS[i])
        self.run(self.tier.flush())

    @rule(num_bytes=st.integers(0, CAPACITY))
    def evict(self, num_bytes):
        assert self.tier.evict(num_bytes) == self.model.evict(num_bytes)
        self.run(self.tier.flush())

    @rule(d=days)
    def advance_clock(self, d):
        self.clock.advance(d * DAY)

    @rule()
    def sweep(self):
        assert self.run(self.tier.sweep()) == self.model.sweep()
        self.run(self.tier.flush())

    @rule()
    def restart(self):
        self.run(self.tier.close())
        self.tier = self.run(self.open_tier())
        self.sweep()  # what the periodic sweep does: learn expiries, drop the expired

    @precondition(lambda self: self.model.entries)
    @rule()
    def damage_oldest_file(self):
        key = next(iter(self.model.entries))
        os.truncate(self.tier.path(key), HEADER_BYTES - 1)
        assert self.run(self.tier.get(key)) is None
        del self.model.entries[key]
        self.run(self.tier.flush())

    @invariant()
    def matches_model(self):
        assert self.tier.keys() == list(self.model.entries)
        assert self.tier.stats()["bytes"] == self.model.used() <= self.CAPACITY
        on_disk = sorted(f for _, _, files in os.walk(self.tier.config.ns_dir)
                         for f in files if f != ".lock")
        assert on_disk == sorted(k.hex() for k in self.model.entries)


TestHostTier = HostMachine.TestCase
TestHostTier.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestDiskTier = DiskMachine.TestCase
TestDiskTier.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)

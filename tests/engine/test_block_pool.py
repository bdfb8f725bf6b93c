"""BlockPool and KVCacheManager: exact block ids, ref counts, prefix hits, LRU eviction."""
from __future__ import annotations

import pytest

from duplex.engine.block_pool import BlockPool
from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.request import Request
from duplex.engine.sampling_params import SamplingParams
from duplex.kvstore import keys as kvkeys

BS = 4


def make_kv(num_blocks: int, evicted=None) -> KVCacheManager:
    hook = (lambda ids, keys: evicted.extend(ids)) if evicted is not None else None
    pool = BlockPool(num_blocks, on_evict=hook)
    ns = kvkeys.namespace("test-model", "float32", BS)
    return KVCacheManager(pool, BS, lambda salt: kvkeys.namespace("m", "f", BS,
                                                                  tenant_salt=salt.encode()) if salt else ns)


def req(tokens, rid="r", salt="") -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0), (), cache_salt=salt)


def test_allocate_free_counts_and_order():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.free([2, 1, 0])
    assert pool.allocate(4) == [3, 2, 1, 0], "least recently freed first"


def test_one_allocation_tells_its_evictions_in_one_call():
    calls = []
    pool = BlockPool(4, on_evict=lambda ids, keys: calls.append((ids, keys)))
    ids = pool.allocate(4)
    for block_id, key in zip(ids, [b"a", b"b", b"c"]):
        pool.publish(block_id, key)
    pool.free(ids)
    assert pool.allocate(4) == [0, 1, 2, 3] and calls == [([0, 1, 2], [b"a", b"b", b"c"])]
    assert pool.lookup(b"a") is None and pool.num_evictions == 3
    pool.publish(0, b"d")
    pool.free([0])
    assert pool.evict_all_cached() == 1 and calls[-1] == ([0], [b"d"])


def test_double_free_is_caught():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids)


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    kv = make_kv(8)
    a = req(list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids(a.req_id) == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.publish(a)
    assert kv.num_published[a.req_id] == 2
    b = req(list(range(8)) + [99, 98, 97], "b")
    hit = kv.find_cached_blocks(b)
    assert hit == [0, 1]
    assert kv.allocate_slots(b, 3, hit)
    assert b.num_computed_tokens == 0, "allocation reserves blocks, it does not move progress"
    b.restore_prefix(*kv.restore_point(b, len(hit), 0))
    assert kv.block_ids(b.req_id) == [0, 1, 3] and b.num_computed_tokens == 8
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1]
    # exactly two full blocks: the hit stops one block short so one token is computed
    c = req(list(range(8)), "c")
    assert kv.find_cached_blocks(c) == [0]


def test_eviction_is_lru_and_deepest_first():
    evicted = []
    kv = make_kv(4, evicted)
    a = req(list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.publish(a)
    kv.free(a)  # blocks 0,1,2 cached; freed deepest first
    assert kv.pool.num_free_blocks == 4
    assert kv.pool.allocate(1) == [3]  # the empty block goes first (it was free longest)
    assert kv.pool.allocate(1) == [2] and evicted == [2], "deepest cached block evicted first"
    b = req(list(range(12)), "b")
    assert kv.find_cached_blocks(b) == [0, 1]


def test_tenants_never_share_blocks():
    kv = make_kv(8)
    a = req(list(range(9)), "a", salt="tenant-a")
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.publish(a)
    assert kv.find_cached_blocks(req(list(range(9)), "b", salt="tenant-b")) == []
    assert kv.find_cached_blocks(req(list(range(9)), "c", salt="tenant-a")) == [0, 1]


def test_failed_allocation_changes_nothing():
    kv = make_kv(3)
    a = req(list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.publish(a)
    kv.free(a)
    b = req(list(range(8)) + list(range(50, 70)), "b")
    hit = kv.find_cached_blocks(b)
    assert hit == [0, 1]
    assert not kv.allocate_slots(b, 20, hit)  # needs 5 more blocks, only 1 is free
    assert kv.block_ids(b.req_id) == [] and kv.pool.ref_cnt == [0, 0, 0]
    assert kv.pool.lookup(kv.block_keys(b.req_id)[0]) == 0, \
        "the cached prefix survives a failed attempt"


# ------------------------------------------------------------------ the hand-off's leases
def test_a_lease_pins_the_cached_prefix_until_released():
    kv = make_kv(4)
    a = req(list(range(10)))  # blocks 0, 1 full and published; block 2 partial
    assert kv.allocate_slots(a, 10)
    a.advance(10)
    kv.publish(a)
    keys = kv.handoff.block_keys("", list(range(12)))  # 3 full blocks; the third not cached
    assert keys[:2] == kv.block_keys(a.req_id)[:2]
    assert kv.handoff.computed_prefix(keys) == [0, 1]
    lease = kv.handoff.lease(keys)
    assert lease.block_ids == [0, 1] and kv.pool.ref_cnt == [2, 2, 1, 0]
    kv.free(a)
    assert kv.pool.ref_cnt == [1, 1, 0, 0] and kv.pool.num_free_blocks == 2
    assert kv.pool.allocate(2) == [3, 2], "leased blocks are neither reused nor evicted"
    kv.handoff.release(lease)
    assert kv.pool.ref_cnt == [0, 0, 1, 1] and kv.pool.lookup(keys[0]) == 0
    assert kv.handoff.num_held(keys) == 2 and not kv.handoff.can_receive


def test_an_evicted_block_ends_the_lease_prefix():
    kv = make_kv(3)
    a = req(list(range(9)))
    assert kv.allocate_slots(a, 9)
    a.advance(9)
    kv.publish(a)
    keys = kv.block_keys(a.req_id)[:2]
    kv.free(a)  # deepest first: the free queue is [2, 1, 0]
    assert kv.pool.allocate(2) == [2, 1]  # evicts block 1, the deeper cached one
    assert kv.pool.lookup(keys[1]) is None
    lease = kv.handoff.lease(keys)
    assert lease.block_ids == [0] and kv.pool.ref_cnt == [1, 1, 1]


# ------------------------------------------------------------------ Request transitions
def test_request_transitions_move_the_counters():
    r = req(list(range(6)))
    r.restore_prefix(4)
    assert r.num_computed_tokens == 4 and not r.is_decoding
    r.advance(2)
    r.add_token(7)
    assert r.is_decoding and r.num_computed_tokens == r.num_tokens - 1
    r.set_drafts([8, 9, 10])
    r.keep_drafts(2)
    assert r.spec_token_ids == [8, 9] and r.token_slice(6, 9) == [7, 8, 9]
    r.advance(3)  # the last token and two drafts
    r.add_token(8)  # one draft accepted, then the bonus token
    r.add_token(5)
    assert r.rollback() == 1 and r.num_computed_tokens == 8 and r.spec_token_ids == []
    r.set_drafts([1])
    r.set_drafts([])
    assert r.spec_token_ids == []
    r.preempt()
    assert (r.num_computed_tokens, r.num_preemptions, r.status.value) == (0, 1, "preempted")
    with pytest.raises(AssertionError):
        r.restore_prefix(r.num_tokens)  # a hit always leaves a token to compute

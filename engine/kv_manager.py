"""KVCacheManager: maps requests to device KV blocks and finds cached prefixes.

It owns each request's block table (``req_to_blocks[req_id]``, as vLLM's), the content keys
of its full blocks and how many of them are published, all keyed by request id; a Request
holds none of it. The BlockPool underneath owns the blocks themselves. Keys come from
``kvstore.keys`` — the one content address shared by the device cache, the router, KV
transfer and the disk store — rooted in a per-tenant namespace.

Contract for readers (the model runner, a drafter, tests): `tables` and `block_ids` give
the live lists, to read and not to keep past the step. A table only grows in place; one
that is replaced (a prefix hit) or cut (a trim) is a new list, so a list that is still
the same object has the same leading entries (engine.model_runner.BlockTables relies on it).

With host/disk tiers (a `TierLink`), a request's cached prefix is read in this order, and
only the rest is computed:

    block index:  0 ......... num_device ........... num_device + num_loaded ...... end
                  | device blocks (shared) | tier entries copied into new blocks | computed |
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

from duplex.engine.block_pool import BlockPool
from duplex.engine.kv_tiers import DEVICE, TIERS, TierHit, TierLink
from duplex.engine.stats import HybridKVStats
from duplex.engine.request import Request
from duplex.kvstore import keys as kvkeys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVTables(NamedTuple):
    """What a step's inputs read of the KV managers: block tables by request id (swa: a
    hybrid layout's sliding-window tables, engine.hybrid_kv; None without one)."""
    full: Mapping[str, list[int]]
    swa: Mapping[str, list[int]] | None = None


class RestorePoint(NamedTuple):
    """A prefix hit's effect on progress, for `Request.restore_prefix` (the scheduler makes
    that transition; allocate_slots only reserves blocks)."""
    num_computed: int  # tokens whose KV the hit leaves computed
    replay_end: int = 0  # positions below it are recomputed for sliding-window layers only


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, namespace: Callable[[str], bytes],
                 enable_prefix_caching: bool = True, tiers: TierLink | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.namespace = namespace  # tenant salt -> namespace bytes
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers if enable_prefix_caching else None
        self.num_hit_tokens = dict.fromkeys(TIERS, 0)  # prompt tokens served, per tier
        self.num_queried_tokens = 0
        self.handoff = KVHandoff(pool, self.tiers, namespace, block_size)
        # by request id; only the KV managers write these (tests/test_ownership.py)
        self.req_to_blocks: dict[str, list[int]] = {}  # block table
        self.req_to_keys: dict[str, list[bytes]] = {}  # content keys of its full blocks
        self.num_published: dict[str, int] = {}  # leading blocks already in the prefix cache
        self.tables = KVTables(self.req_to_blocks)

    # ------------------------------------------------------------------ readers
    def block_ids(self, req_id: str) -> list[int]:
        """req_id's block table (empty without blocks); read it, do not keep it."""
        return self.req_to_blocks.get(req_id) or []

    def block_keys(self, req_id: str) -> list[bytes]:
        """Content keys of req_id's full blocks computed so far (update_keys)."""
        return self.req_to_keys.get(req_id) or []

    # ------------------------------------------------------------------ prefix cache
    def update_keys(self, req: Request, num_tokens: int) -> list[bytes]:
        """req's block keys, extended to cover the full blocks among its first num_tokens
        tokens."""
        keys = self.req_to_keys.setdefault(req.req_id, [])
        num_full = num_tokens // self.block_size
        if len(keys) >= num_full:
            return keys
        start = len(keys)
        parent = keys[-1] if keys else None
        tokens = req.all_token_ids[:num_full * self.block_size]
        keys.extend(kvkeys.block_keys(self.namespace(req.cache_salt), tokens,
                                      self.block_size, parent=parent, start_block=start))
        return keys

    def find_cached_blocks(self, req: Request) -> list[int]:
        """Device blocks holding the longest cached prefix of req. At least one token is
        always left to compute, so the hit stops short of the request's last token."""
        max_blocks = self._num_hittable_blocks(req)
        keys = self.update_keys(req, max_blocks * self.block_size)
        hit = []
        for key in keys[:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None or (self.tiers is not None and not self.tiers.is_live(block_id)):
                break
            hit.append(block_id)
        return hit

    def restore_point(self, req: Request, num_hit_blocks: int, num_loaded: int) -> RestorePoint:
        """Where req's progress restarts after a hit of num_hit_blocks device and num_loaded
        tier blocks (engine.hybrid_kv may start lower, to rebuild sliding-window state)."""
        return RestorePoint((num_hit_blocks + num_loaded) * self.block_size)

    def hybrid_stats(self) -> HybridKVStats | None:
        """Hybrid KV's figures (engine.hybrid_kv); None for this manager."""
        return None

    def _num_hittable_blocks(self, req: Request) -> int:
        """Full blocks a hit may cover: all but the last token (it must be computed)."""
        return (req.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0

    # ------------------------------------------------------------------ host / disk tiers
    def start_loads(self, req: Request) -> None:
        """On arrival: start disk reads for the part of req's prefix not on the device, so
        they overlap other requests' compute."""
        if self.tiers is not None:
            num_device = len(self.find_cached_blocks(req))
            keys = self.block_keys(req.req_id)[num_device:self._num_hittable_blocks(req)]
            self.tiers.start_load(req.req_id, keys)

    def is_loading(self, req: Request) -> bool:
        return self.tiers is not None and self.tiers.is_loading(req.req_id)

    def wait_for_loads(self, reqs) -> bool:
        """Block until one of reqs' disk reads lands or times out; False if none pending."""
        return self.tiers is not None and self.tiers.wait_for_loads([r.req_id for r in reqs])

    def find_tier_blocks(self, req: Request, num_device_blocks: int) -> list[TierHit]:
        """Tier entries that continue req's device prefix hit, up to the first miss."""
        if self.tiers is None:
            return []
        keys = self.block_keys(req.req_id)[num_device_blocks:self._num_hittable_blocks(req)]
        return self.tiers.find(req.req_id, keys)

    def record_hit(self, req: Request, num_device_blocks: int, loaded: list[TierHit]) -> None:
        """Count a scheduled request's prefix hit; its first scheduling sets what it reports."""
        by_tier = dict.fromkeys(TIERS, 0)
        by_tier[DEVICE] = num_device_blocks * self.block_size
        for hit in loaded:
            by_tier[hit.tier] += self.block_size
        for tier, num in by_tier.items():
            self.num_hit_tokens[tier] += num
        self.num_queried_tokens += req.num_tokens
        req.record_cached(by_tier)
        if self.tiers is not None:
            self.tiers.forget(req.req_id)

    # ------------------------------------------------------------------ allocation
    def num_blocks_needed(self, req: Request, num_held: int, num_new_tokens: int,
                          num_hit_blocks: int = 0, num_loaded_blocks: int = 0) -> int:
        """New blocks for num_new_tokens more tokens of req, which holds num_held blocks,
        after a prefix hit of num_hit_blocks device blocks and num_loaded_blocks tier
        blocks (which need new blocks too)."""
        have = max(num_held, num_hit_blocks)
        num_cached = (num_hit_blocks + num_loaded_blocks) * self.block_size
        total = max(req.num_computed_tokens, num_cached) + num_new_tokens
        return max(0, cdiv(total, self.block_size) - have)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit_block_ids: list[int] | None = None,
                       loaded: list[TierHit] = ()) -> bool:
        """Reserve KV slots for num_new_tokens more tokens of req, after an optional prefix
        hit (device blocks, then tier entries copied into new blocks), which only a request
        with no blocks may take. False, with nothing changed, when the pool cannot supply
        them. The request's progress does not move: after a hit the caller restores it
        (restore_point)."""
        hit_block_ids = hit_block_ids or []
        table = self.req_to_blocks.get(req.req_id)
        assert not (hit_block_ids or loaded) or not table, "a prefix hit needs an empty request"
        need = self.num_blocks_needed(req, len(table or ()), num_new_tokens, len(hit_block_ids),
                                      len(loaded))
        pinned = sum(1 for b in hit_block_ids if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free_blocks - pinned:
            return False
        if hit_block_ids:
            self.pool.touch(hit_block_ids)
        if table:
            table.extend(self.pool.allocate(need))  # grows in place (module docstring)
        else:
            self.req_to_blocks[req.req_id] = hit_block_ids + self.pool.allocate(need)
        if loaded:
            self._load(req, len(hit_block_ids), loaded)
        if hit_block_ids or loaded:
            self.num_published[req.req_id] = len(hit_block_ids) + len(loaded)
        return True

    def _load(self, req: Request, start: int, loaded: list[TierHit]) -> None:
        """Copy tier entries into req's blocks start.. and publish them (they hold exactly
        the content their keys name, so later requests may hit them on the device)."""
        block_ids = self.req_to_blocks[req.req_id][start:start + len(loaded)]
        keys = self.req_to_keys[req.req_id]
        self.tiers.load(block_ids, [hit.entry for hit in loaded])  # one batched copy
        for i, block_id in enumerate(block_ids, start):
            self.pool.publish(block_id, keys[i])

    def publish(self, req: Request) -> None:
        """Make req's fully computed blocks addressable for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        num_published = self.num_published.get(req.req_id, 0)
        if num_full <= num_published:
            return
        keys = self.update_keys(req, num_full * self.block_size)
        table = self.req_to_blocks[req.req_id]
        new_ids, new_keys = [], []
        for i in range(num_published, num_full):
            block_id, key = table[i], keys[i]
            if self.pool.publish(block_id, key):
                new_ids.append(block_id)
                new_keys.append(key)
        if new_ids and self.tiers is not None:
            self.tiers.on_publish(new_ids, new_keys, req.retention)  # one batched copy
        self.num_published[req.req_id] = num_full

    def trim(self, req: Request) -> None:
        """Free req's blocks past those its tokens need. After verification rejected draft
        tokens, a block that held only their slots is empty again: it was never published
        (it lies past num_computed_tokens), so it goes back to be reused first."""
        keep = cdiv(req.num_tokens, self.block_size)
        table = self.block_ids(req.req_id)
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]), reuse_first=True)
            self.req_to_blocks[req.req_id] = table[:keep]  # cut: a new list (docstring)

    def free(self, req: Request) -> None:
        """Release req's blocks, deepest first, so shallow prefix blocks outlive deep ones,
        and forget its table and keys (a preempted request's keys are made again)."""
        self.pool.free(reversed(self.req_to_blocks.pop(req.req_id, [])))
        self.req_to_keys.pop(req.req_id, None)
        self.num_published.pop(req.req_id, None)
        if self.tiers is not None:
            self.tiers.forget(req.req_id)

    def drop_cached(self) -> int:
        """Forget every cached, unreferenced device block (each goes to the tiers below, as
        an eviction would send it); returns how many. A benchmark's way to measure them."""
        return self.pool.evict_all_cached()


class KVLease(NamedTuple):
    """Device blocks pinned for someone other than a request (a hand-off in flight): they
    are neither reused nor evicted until `KVHandoff.release`. block_ids[i] holds the
    content of the i-th key the lease was taken on."""
    block_ids: list[int]


class KVHandoff:
    """The KV cache as the prefill/decode hand-off sees it (engine.kv_transfer): content
    keys in, block ids and leases out. Requests, reference counts and the tiers' expiry
    stay with their owners; this is the only way the hand-off touches blocks.

    Contract: block ids from `computed_prefix` are valid until the next step; those of a
    lease until it is released (exactly once)."""

    def __init__(self, pool: BlockPool, tiers: TierLink | None,
                 namespace: Callable[[str], bytes], block_size: int) -> None:
        self._pool = pool
        self._tiers = tiers
        self._namespace = namespace
        self.block_size = block_size

    def block_keys(self, cache_salt: str, token_ids: list[int]) -> list[bytes]:
        """Content keys of the full blocks of token_ids in the tenant's namespace."""
        return kvkeys.block_keys(self._namespace(cache_salt), token_ids, self.block_size)

    def computed_prefix(self, keys: list[bytes]) -> list[int]:
        """Device blocks holding the leading keys whose KV is complete (published) now."""
        block_ids = []
        for key in keys:
            block_id = self._pool.lookup(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def lease(self, keys: list[bytes]) -> KVLease:
        """Pin the device blocks of the leading keys cached now (up to the first miss)."""
        block_ids = self.computed_prefix(keys)
        self._pool.touch(block_ids)
        return KVLease(block_ids)

    def release(self, lease: KVLease) -> None:
        """Unpin a lease's blocks, deepest first (they stay cached until evicted)."""
        self._pool.free(reversed(lease.block_ids))

    @property
    def can_receive(self) -> bool:
        """Whether blocks from elsewhere can be stored here (a host tier exists)."""
        return self._tiers is not None and self._tiers.can_store

    def num_held(self, keys: list[bytes]) -> int:
        """Leading blocks of keys already here: on the device, then in the tiers."""
        num_device = len(self.computed_prefix(keys))
        if self._tiers is None:
            return num_device
        return num_device + self._tiers.num_stored(keys[num_device:])

    def store(self, key: bytes, payload, retention: str) -> None:
        """Keep a received block (raw bytes of this layout) in the host tier, expiring as
        its retention class says; later requests find it as a tier hit."""
        assert self.can_receive, "store needs a host tier (check can_receive first)"
        self._tiers.store(key, payload, retention)

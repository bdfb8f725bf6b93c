"""KVCacheManager: maps requests to device KV blocks and finds cached prefixes.

It owns each request's block table (``req.block_ids``) and its content keys
(``req.block_keys``); the BlockPool underneath owns the blocks themselves. Keys come from
``kvstore.keys`` — the one content address shared by the device cache, the router, KV
transfer and the disk store — rooted in a per-tenant namespace.
"""
from __future__ import annotations

from typing import Callable

from engine.block_pool import BlockPool
from engine.request import Request
from kvstore import keys as kvkeys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, namespace: Callable[[str], bytes],
                 enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.namespace = namespace  # tenant salt -> namespace bytes
        self.enable_prefix_caching = enable_prefix_caching
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    # ------------------------------------------------------------------ prefix cache
    def update_keys(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_keys to cover the full blocks among the first num_tokens tokens."""
        num_full = num_tokens // self.block_size
        if len(req.block_keys) >= num_full:
            return
        start = len(req.block_keys)
        parent = req.block_keys[-1] if req.block_keys else None
        tokens = req.all_token_ids[:num_full * self.block_size]
        req.block_keys.extend(kvkeys.block_keys(self.namespace(req.cache_salt), tokens,
                                                self.block_size, parent=parent,
                                                start_block=start))

    def find_cached_blocks(self, req: Request) -> list[int]:
        """Device blocks holding the longest cached prefix of req. At least one token is
        always left to compute, so the hit stops short of the request's last token."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self.update_keys(req, max_blocks * self.block_size)
        hit = []
        for key in req.block_keys[:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # ------------------------------------------------------------------ allocation
    def num_blocks_needed(self, req: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        have = max(len(req.block_ids), num_hit_blocks)
        total = max(req.num_computed_tokens, num_hit_blocks * self.block_size) + num_new_tokens
        return max(0, cdiv(total, self.block_size) - have)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit_block_ids: list[int] | None = None) -> bool:
        """Reserve KV slots for num_new_tokens more tokens of req (after an optional prefix
        hit, which only a request with no blocks may take). False, with nothing changed,
        when the pool cannot supply them."""
        hit_block_ids = hit_block_ids or []
        assert not hit_block_ids or not req.block_ids, "a prefix hit needs an empty request"
        need = self.num_blocks_needed(req, num_new_tokens, len(hit_block_ids))
        pinned = sum(1 for b in hit_block_ids if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free_blocks - pinned:
            return False
        if hit_block_ids:
            self.pool.touch(hit_block_ids)
            req.block_ids = list(hit_block_ids)
            req.num_computed_tokens = len(hit_block_ids) * self.block_size
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def publish(self, req: Request) -> None:
        """Make req's fully computed blocks addressable for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_published_blocks:
            return
        self.update_keys(req, num_full * self.block_size)
        for i in range(req.num_published_blocks, num_full):
            self.pool.publish(req.block_ids[i], req.block_keys[i])
        req.num_published_blocks = num_full

    def free(self, req: Request) -> None:
        """Release req's blocks, deepest first, so shallow prefix blocks outlive deep ones."""
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_published_blocks = 0

    def slot(self, req: Request, position: int) -> int:
        return req.block_ids[position // self.block_size] * self.block_size + position % self.block_size

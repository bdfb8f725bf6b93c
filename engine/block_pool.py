"""BlockPool: the only owner of device KV blocks, their reference counts and the prefix map.

A block is in exactly one of three states:

    | state    | ref_cnt | in free queue | key            |
    |----------|---------|---------------|----------------|
    | used     | >= 1    | no            | maybe (cached) |
    | cached   | 0       | yes           | yes            |  <- still addressable, evictable
    | empty    | 0       | yes           | no             |

Allocation pops from the front of the free queue (least recently freed first). Cached
blocks are evicted when popped: their key leaves the prefix map and `on_evict` is told,
once per call with every block that call evicted (one batched copy for a lower tier to
keep their content, not one per block). Callers free a request's blocks deepest first, so
the deepest blocks of a prefix are evicted before its shallow ones.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int,
                 on_evict: Callable[[list[int], list[bytes]], None] | None = None) -> None:
        assert num_blocks >= 1, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict = on_evict
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (empty or evictable cached)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise MemoryError(f"need {num} KV blocks, {len(self._free)} free")
        block_ids, evicted, keys = [], [], []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            key = self._evict_key(block_id)
            if key is not None:
                evicted.append(block_id)
                keys.append(key)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        self._tell_evicted(evicted, keys)
        return block_ids

    def free(self, block_ids: Iterable[int], reuse_first: bool = False) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in
        the order given (pass deepest first). reuse_first: empty blocks (no key) go to the
        front instead, so taking them back evicts no cached block (speculation's trim)."""
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"block {block_id} freed twice"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None
                if reuse_first and self.block_key[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def lookup(self, key: bytes) -> int | None:
        return self.key_to_block.get(key)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def publish(self, block_id: int, key: bytes) -> bool:
        """Make a used, fully computed block addressable by its content key; False if it
        already was (here, or the same content in another block)."""
        assert self.ref_cnt[block_id] > 0, "only used blocks are published"
        if self.block_key[block_id] is not None or key in self.key_to_block:
            return False
        self.block_key[block_id] = key
        self.key_to_block[key] = block_id
        return True

    def evict_all_cached(self) -> int:
        """Forget every cached (unreferenced) block; returns how many were dropped."""
        evicted = [b for b in self._free if self.block_key[b] is not None]
        self._tell_evicted(evicted, [self._evict_key(b) for b in evicted])
        return len(evicted)

    def _evict_key(self, block_id: int) -> bytes | None:
        """Drop the block's key from the prefix map; the key, or None when it had none."""
        key = self.block_key[block_id]
        if key is None:
            return None
        self.block_key[block_id] = None
        del self.key_to_block[key]
        self.num_evictions += 1
        return key

    def _tell_evicted(self, block_ids: list[int], keys: list[bytes]) -> None:
        """on_evict, once, for blocks whose content is still intact."""
        if block_ids and self.on_evict is not None:
            self.on_evict(block_ids, keys)

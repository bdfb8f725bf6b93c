"""Hybrid KV: full-attention and sliding-window layers keep their KV in separate block groups.

A model with sliding-window (SWA) layers gets two KV tensors and two block pools:

    | group | layers         | tensor / pool            | a request's table        | keeps           |
    |-------|----------------|--------------------------|--------------------------|-----------------|
    | full  | window is None | runner.kv / pool         | req_to_blocks[req_id]     | every block     |
    | swa   | window W       | runner.swa_kv / swa_pool | req_to_swa_blocks[req_id] | the window only |

An SWA table has one entry per block of the request, like the full one, but entries older
than the window point at NULL (one extra block past the pool, never written, always zero):
attention masks them, so they are never read into a result. Out-of-window SWA blocks go back
to the SWA pool as decoding moves on, so a request holds about ceil(W / block_size) + 1 of
them whatever its length.

Prefix cache ("bonded windows"). Full-attention blocks are published by content key as
today. The SWA state at a block boundary B is the SWA KV of positions B - W + 1 .. B - 1;
a *bond* keeps those SWA blocks (a reference on each), addressed by the key of the block
ending at B. Bonds are made where continuations start: when a request ends (a turn end)
and where a replay rebuilt a window (a branch point, e.g. a shared system prompt). A
request that continues from a turn-end bond drops it when it leaves its own.

A hit of H tokens restores the full KV of blocks < H and, if a bond sits at H, its window:
only the new tokens are computed. Otherwise the SWA state is rebuilt by replay: tokens from
`start` to H run through every layer again; full-attention layers skip writing them
(slot -1: their cached KV is already there) and SWA layers write theirs. Exactness needs
`start` at a bond (then replay = H - start), or else H - start >= num_swa_layers * (W - 1):
an SWA layer's KV at p is exact once its input at p is, which holds W - 1 positions
further per SWA layer below it (full layers read cached KV, so they do not widen this).

    token index:  0 ...... start ........... H ............... num_tokens
                  | restored | replayed (SWA only) | prefilled |
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from duplex.engine.block_pool import BlockPool
from duplex.engine.kv_manager import KVCacheManager, KVTables, RestorePoint, cdiv
from duplex.engine.kv_tiers import TierHit, TierLink
from duplex.engine.request import Request
from duplex.engine.stats import HybridKVStats
from duplex.kernels import memory
from duplex.kernels.kv_store import row_width


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    """Which layers are in which group and how many blocks each pool has."""
    full_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    window: int  # the widest window among the SWA layers
    num_full_blocks: int
    num_swa_blocks: int  # NULL is block num_swa_blocks of the SWA tensor

    @property
    def null_block(self) -> int:
        return self.num_swa_blocks

    @classmethod
    def plan(cls, layer_windows: Sequence[int | None], num_blocks: int, block_size: int,
             max_num_seqs: int, max_num_batched_tokens: int) -> HybridLayout | None:
        """Split the bytes of num_blocks all-layer blocks between the groups; None for a
        model without SWA layers (it keeps the single-group layout). The SWA pool is sized
        for every sequence's window plus one step's chunk; the rest goes to full blocks."""
        swa = tuple(i for i, w in enumerate(layer_windows) if w is not None)
        if not swa:
            return None
        full = tuple(i for i, w in enumerate(layer_windows) if w is None)
        window = max(layer_windows[i] for i in swa)
        per_seq = cdiv(window, block_size) + 1
        chunk = cdiv(max_num_batched_tokens, block_size) + 1
        num_swa = max(min(num_blocks, max_num_seqs * per_seq + chunk), per_seq + chunk)
        budget = num_blocks * len(layer_windows) - num_swa * len(swa)  # in layer-blocks
        num_full = max(num_blocks, budget // len(full)) if full else num_blocks
        return cls(full, swa, window, num_full, num_swa)

    def allocate(self, args, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """(full kv, swa kv, per-layer (k_cache, v_cache)) tensors on `device`, zeroed (an int8
        pool's rows: head_dim values and a scale, kernels.kv_store; NULL dequantizes to 0)."""
        shape = (block_size, args.num_kv_heads, row_width(args.head_dim, dtype))

        def zeros(*dims):  # on the CPU: pages resident once written (kernels.memory.zeros)
            if torch.device(device).type == "cpu":
                return memory.zeros(dims, dtype)
            return torch.zeros(dims, dtype=dtype, device=device)

        kv = zeros(len(self.full_layers), 2, self.num_full_blocks, *shape)
        swa_kv = zeros(len(self.swa_layers), 2, self.num_swa_blocks + 1, *shape)
        caches = {}
        for i, layer in enumerate(self.full_layers):
            caches[layer] = (kv[i, 0], kv[i, 1])
        for i, layer in enumerate(self.swa_layers):
            caches[layer] = (swa_kv[i, 0], swa_kv[i, 1])
        return kv, swa_kv, [caches[i] for i in range(len(caches))]

    def bytes_per_block(self, args, block_size: int, dtype: torch.dtype) -> tuple[int, int]:
        """Bytes of one full-group block and one SWA-group block."""
        row = row_width(args.head_dim, dtype) * dtype.itemsize
        layer = 2 * block_size * args.num_kv_heads * row
        return layer * len(self.full_layers), layer * len(self.swa_layers)


def swa_step_inputs(scheduled, swa_tables: Mapping[str, list[int]], block_size: int,
                    null_block: int, num_cols: int):
    """SWA block tables [num_seqs, num_cols] (int32, NULL-padded) and slot mapping of a step."""
    tables = torch.full((len(scheduled), num_cols), null_block, dtype=torch.int32)
    slots = []
    for row, (req, num_new) in enumerate(scheduled):
        table = torch.tensor(swa_tables[req.req_id], dtype=torch.long)
        tables[row, :len(table)] = table.to(torch.int32)
        pos = torch.arange(req.num_computed_tokens, req.num_computed_tokens + num_new)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return tables, torch.cat(slots)


MAX_ACCOUNTED = 4096  # finished requests whose accounting is kept for callers to read


class Bond(NamedTuple):
    first_block: int  # block index of block_ids[0] in the request's table
    block_ids: list[int]  # SWA blocks of the window, oldest first (one reference each)
    is_turn_end: bool


class RestorePlan(NamedTuple):
    start: int  # first token to compute
    bond_key: bytes | None  # the bond restored at start, if any


class Accounting(NamedTuple):
    num_restored: int
    num_replayed: int
    num_prefilled: int


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager for a hybrid layout: the base class runs the full group (block ids,
    keys, tiers); this adds the SWA tables (req_to_swa_blocks, by request id, NULL out of
    the window: entries change in place), their release, bonds and replay. Tier entries
    carry the full group only: a tier hit rebuilds the SWA state by replay."""

    def __init__(self, pool: BlockPool, swa_pool: BlockPool, layout: HybridLayout,
                 block_size: int, namespace: Callable[[str], bytes],
                 enable_prefix_caching: bool = True, tiers: TierLink | None = None,
                 block_bytes: tuple[int, int] = (0, 0)) -> None:
        super().__init__(pool, block_size, namespace, enable_prefix_caching, tiers)
        self.swa_pool = swa_pool
        self.req_to_swa_blocks: dict[str, list[int]] = {}
        self.tables = KVTables(self.req_to_blocks, self.req_to_swa_blocks)
        self.block_bytes = block_bytes  # (full-group block, SWA-group block)
        self.layout = layout
        self.window = layout.window
        self.null = layout.null_block
        self.replay_span = len(layout.swa_layers) * (layout.window - 1)
        self.bonds: OrderedDict[bytes, Bond] = OrderedDict()  # least recently used first
        self._consumed: dict[str, bytes] = {}  # req_id -> turn-end bond it continued from
        self._branch: dict[str, int] = {}  # req_id -> boundary to bond once replay is done
        self.accounting: OrderedDict[str, Accounting] = OrderedDict()  # last admission, recent
        self.totals = dict(restored=0, replayed=0, prefilled=0)

    def swa_block_ids(self, req_id: str) -> list[int]:
        """req_id's SWA table (NULL out of the window); read it, do not keep it."""
        return self.req_to_swa_blocks.get(req_id) or []

    # ------------------------------------------------------------------ planning
    def restore_point(self, req: Request, num_hit_blocks: int, num_loaded: int) -> RestorePoint:
        num_hit = (num_hit_blocks + num_loaded) * self.block_size
        return RestorePoint(self._plan(req, num_hit).start, num_hit) if num_hit else \
            RestorePoint(0)

    def _plan(self, req: Request, num_hit: int) -> RestorePlan:
        """Where to start computing after a hit of num_hit tokens: at the nearest bond at
        or below it within the replay span, else num_hit - replay_span (block-aligned)."""
        bs = self.block_size
        cold = max(0, num_hit - self.replay_span) // bs * bs
        keys = self.block_keys(req.req_id)
        for boundary in range(num_hit, cold, -bs):
            key = keys[boundary // bs - 1]
            if key in self.bonds:
                return RestorePlan(boundary, key)
        return RestorePlan(cold, None)

    def _window_first_block(self, boundary: int) -> int:
        """First block holding a position an SWA query at `boundary` can see."""
        return max(0, boundary - self.window + 1) // self.block_size

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit_block_ids: list[int] | None = None,
                       loaded: list[TierHit] = ()) -> bool:
        hit_block_ids = hit_block_ids or []
        num_hit = (len(hit_block_ids) + len(loaded)) * self.block_size
        plan = self._plan(req, num_hit) if num_hit else \
            RestorePlan(req.num_computed_tokens, None)
        bond = self.bonds.get(plan.bond_key) if plan.bond_key else None
        need = self._num_swa_needed(req, plan.start, num_new_tokens, bond)
        if not self._reserve_swa(need, keep=plan.bond_key):
            return False
        num_full_new = num_new_tokens - max(0, num_hit - plan.start)
        if not super().allocate_slots(req, max(0, num_full_new), hit_block_ids, loaded):
            return False
        if num_hit:
            self._restore(req, num_hit, plan, bond)
        self._extend_swa(req, plan.start, plan.start + num_new_tokens)
        return True

    def _num_swa_needed(self, req: Request, start: int, num_new: int, bond: Bond | None) -> int:
        table = self.swa_block_ids(req.req_id)
        if bond is not None:
            table = [self.null] * bond.first_block + bond.block_ids
        first, end = start // self.block_size, cdiv(start + num_new, self.block_size)
        return sum(1 for i in range(first, end) if i >= len(table) or table[i] == self.null)

    def _reserve_swa(self, num: int, keep: bytes | None) -> bool:
        """Evict least recently used bonds (not `keep`) until num SWA blocks are free."""
        for key in list(self.bonds):
            if self.swa_pool.num_free_blocks >= num:
                break
            if key != keep:
                self._drop_bond(key)
        return self.swa_pool.num_free_blocks >= num

    def _restore(self, req: Request, num_hit: int, plan: RestorePlan, bond: Bond | None) -> None:
        """After the base class took the full-group hit: the bond's window in the SWA table;
        the request restarts at plan.start (restore_point) and positions below num_hit only
        rebuild SWA KV."""
        self.req_to_swa_blocks[req.req_id] = []
        if bond is not None:
            self.bonds.move_to_end(plan.bond_key)
            self.swa_pool.touch(bond.block_ids)
            self.req_to_swa_blocks[req.req_id] = [self.null] * bond.first_block + \
                list(bond.block_ids)
            if bond.is_turn_end:
                self._consumed[req.req_id] = plan.bond_key
        if plan.start < num_hit:
            self._branch[req.req_id] = num_hit
        self._account(req, Accounting(plan.start, num_hit - plan.start, req.num_tokens - num_hit))

    def _account(self, req: Request, acc: Accounting) -> None:
        self.accounting[req.req_id] = acc
        while len(self.accounting) > MAX_ACCOUNTED:
            self.accounting.popitem(last=False)
        for name, num in zip(("restored", "replayed", "prefilled"), acc):
            self.totals[name] += num

    def _extend_swa(self, req: Request, start: int, end: int) -> None:
        """SWA blocks for every position below end from start (the first to compute) on."""
        table = self.req_to_swa_blocks.setdefault(req.req_id, [])
        first, num_blocks = start // self.block_size, cdiv(end, self.block_size)
        table.extend([self.null] * (num_blocks - len(table)))
        missing = [i for i in range(first, num_blocks) if table[i] == self.null]
        for i, block_id in zip(missing, self.swa_pool.allocate(len(missing))):
            table[i] = block_id

    def record_hit(self, req: Request, num_device_blocks: int, loaded: list[TierHit]) -> None:
        if not (num_device_blocks or loaded):
            self._account(req, Accounting(0, 0, req.num_tokens))
        super().record_hit(req, num_device_blocks, loaded)

    # ------------------------------------------------------------------ after a step
    def publish(self, req: Request) -> None:
        """Called after each step of req: publish full blocks, bond a rebuilt window, and
        release SWA blocks that fell out of the window."""
        super().publish(req)
        branch = self._branch.get(req.req_id)
        if branch is not None and req.num_computed_tokens >= branch:
            del self._branch[req.req_id]
            self._bond(req, branch, is_turn_end=False)
        self._release_out_of_window(req)

    def _release_out_of_window(self, req: Request) -> None:
        bs = self.block_size
        keep_from = self._window_first_block(req.num_computed_tokens // bs * bs)
        table = self.swa_block_ids(req.req_id)
        old = [i for i in range(min(keep_from, len(table))) if table[i] != self.null]
        self.swa_pool.free(reversed([table[i] for i in old]))
        for i in old:
            table[i] = self.null

    def _bond(self, req: Request, boundary: int, is_turn_end: bool) -> bytes | None:
        """Keep the SWA window at `boundary` (a block boundary req has computed past)."""
        if not self.enable_prefix_caching or boundary <= 0:
            return None
        key = self.update_keys(req, boundary)[boundary // self.block_size - 1]
        if key in self.bonds:
            self.bonds.move_to_end(key)
            return key
        first = self._window_first_block(boundary)
        block_ids = self.swa_block_ids(req.req_id)[first:boundary // self.block_size]
        assert self.null not in block_ids, "a bond's window must be held by the request"
        self.swa_pool.touch(block_ids)
        self.bonds[key] = Bond(first, block_ids, is_turn_end)
        return key

    def _drop_bond(self, key: bytes) -> None:
        bond = self.bonds.pop(key)
        self.swa_pool.free(reversed(bond.block_ids))

    def free(self, req: Request) -> None:
        """Leave a turn-end bond at req's last computed boundary (once any replay is done),
        drop the turn-end bond it continued from, then release its blocks."""
        replaying = req.req_id in self._branch
        self._branch.pop(req.req_id, None)
        old = self._consumed.pop(req.req_id, None)
        new = None
        table = self.swa_block_ids(req.req_id)
        if not replaying and table:
            boundary = req.num_computed_tokens // self.block_size * self.block_size
            if self._window_first_block(boundary) < len(table):
                new = self._bond(req, boundary, is_turn_end=True)
        if old is not None and old != new and old in self.bonds:
            self._drop_bond(old)
        self.swa_pool.free(reversed([b for b in table if b != self.null]))
        self.req_to_swa_blocks.pop(req.req_id, None)
        super().free(req)  # a preempted request's replay_end is reset by Request.preempt

    # ------------------------------------------------------------------ metrics
    def num_swa_blocks_held(self, req: Request) -> int:
        return sum(1 for b in self.swa_block_ids(req.req_id) if b != self.null)

    def stored_bytes(self) -> int:
        """Bytes of cached KV: published full blocks plus the SWA blocks bonds hold."""
        swa_blocks = {b for bond in self.bonds.values() for b in bond.block_ids}
        full_bytes, swa_bytes = self.block_bytes
        return len(self.pool.key_to_block) * full_bytes + len(swa_blocks) * swa_bytes

    def hybrid_stats(self) -> HybridKVStats:
        return HybridKVStats(bytes_stored=float(self.stored_bytes()),
                             cached_tokens=float(len(self.pool.key_to_block) * self.block_size),
                             tokens_restored=float(self.totals["restored"]),
                             tokens_replayed=float(self.totals["replayed"]),
                             tokens_prefilled=float(self.totals["prefilled"]),
                             bonds=float(len(self.bonds)),
                             swa_blocks_used=float(self.swa_pool.num_used_blocks))

"""Expert placement: which logical expert each physical slot holds, and how tokens pick a replica.

Owns the immutable `Placement` value and the pure functions that compute, evaluate, diff and
route through placements. Nothing here keeps state between calls (`route` updates the caller's
`replica_load` counter in place, by contract).

Slot layout of one layer (ranks own contiguous slot ranges, `s_r = slots_per_rank[r]`):

    slot  | 0 ....... s_0-1 | s_0 ..... s_0+s_1-1 | ... | num_slots-s_{N-1} .. num_slots-1 |
    rank  |        0        |          1          | ... |              N-1                 |

`num_slots = num_experts + num_redundant`. When `num_ranks` divides it every rank has the same
number of slots; otherwise the first `num_slots % num_ranks` ranks hold one slot more (the
default 64 ranks x (256 + 32) slots gives 4.5 per rank: 32 ranks of 5, 32 ranks of 4).

Load model: an expert's tokens are split evenly over its replicas (what `route` converges to),
so a replica of expert `e` carries `load[e] / replica_count[e]`. The balancing algorithm itself
lives in `packing`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from duplex.engine.eplb import packing


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """For every layer, the logical expert held by each physical slot."""
    slot_to_expert: np.ndarray  # [num_layers, num_slots] int64, read-only
    num_experts: int
    slots_per_rank: tuple[int, ...]  # [num_ranks]; sums to num_slots

    def __post_init__(self):
        table = np.array(self.slot_to_expert, dtype=np.int64, copy=True)
        if table.ndim == 1:
            table = table[None, :]
        budgets = tuple(int(s) for s in self.slots_per_rank)
        if table.ndim != 2:
            raise ValueError(f"slot_to_expert must be [num_layers, num_slots], got {table.shape}")
        if not budgets or min(budgets) < 1 or sum(budgets) != table.shape[1]:
            raise ValueError(f"slots_per_rank {budgets} must be positive and sum to the "
                             f"number of slots ({table.shape[1]})")
        if table.size and (table.min() < 0 or table.max() >= self.num_experts):
            raise ValueError(f"slot_to_expert holds ids outside [0, {self.num_experts})")
        for layer, row in enumerate(table):
            if np.unique(row).size != self.num_experts:
                raise ValueError(f"layer {layer}: not every expert has a slot")
        table.flags.writeable = False
        object.__setattr__(self, "slot_to_expert", table)
        object.__setattr__(self, "slots_per_rank", budgets)

    @property
    def num_layers(self) -> int:
        return self.slot_to_expert.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_to_expert.shape[1]

    @property
    def num_ranks(self) -> int:
        return len(self.slots_per_rank)

    @functools.cached_property
    def slot_rank(self) -> np.ndarray:
        """[num_slots]: the rank owning each slot."""
        return _readonly(np.repeat(np.arange(self.num_ranks), self.slots_per_rank))

    @functools.cached_property
    def replica_count(self) -> np.ndarray:
        """[num_layers, num_experts]: how many slots hold each expert (always >= 1)."""
        counts = [np.bincount(row, minlength=self.num_experts) for row in self.slot_to_expert]
        return _readonly(np.stack(counts))

    @functools.cached_property
    def expert_to_slots(self) -> np.ndarray:
        """[num_layers, num_experts, max_replicas]: slots of each expert, ascending, -1 padded."""
        max_replicas = int(self.replica_count.max())
        table = np.full((self.num_layers, self.num_experts, max_replicas), -1, dtype=np.int64)
        for layer, row in enumerate(self.slot_to_expert):
            slots = np.argsort(row, kind="stable")  # grouped by expert, slots ascending
            starts = np.cumsum(self.replica_count[layer]) - self.replica_count[layer]
            column = np.arange(self.num_slots) - np.repeat(starts, self.replica_count[layer])
            table[layer, row[slots], column] = slots
        return _readonly(table)

    def rank_slots(self, rank: int) -> slice:
        """The slot range owned by `rank`."""
        start = sum(self.slots_per_rank[:rank])
        return slice(start, start + self.slots_per_rank[rank])

    def __eq__(self, other) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (self.num_experts == other.num_experts
                and self.slots_per_rank == other.slots_per_rank
                and np.array_equal(self.slot_to_expert, other.slot_to_expert))

    def __hash__(self) -> int:
        return hash((self.num_experts, self.slots_per_rank, self.slot_to_expert.tobytes()))


class Move(NamedTuple):
    """Load `expert`'s weights into `slot` of `layer`."""
    layer: int
    slot: int
    expert: int


def even_slot_budget(num_slots: int, num_ranks: int) -> tuple[int, ...]:
    """Split `num_slots` over ranks as evenly as possible; the first ranks get the remainder."""
    if num_ranks < 1 or num_slots < num_ranks:
        raise ValueError(f"cannot give {num_ranks} ranks at least one of {num_slots} slots")
    return packing.even_split(num_slots, num_ranks)


def identity_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """Expert e in slot e, no replicas: the layout a model has before any balancing."""
    row = np.arange(num_experts)
    return Placement(np.tile(row, (num_layers, 1)), num_experts,
                     even_slot_budget(num_experts, num_ranks))


def rank_load(load: np.ndarray, placement: Placement) -> np.ndarray:
    """[num_layers, num_ranks]: tokens each rank computes, replicas sharing their expert evenly.

    `load` is [num_layers, num_experts] (tokens routed to each logical expert)."""
    load = _check_load(load, placement.num_layers, placement.num_experts)
    table = placement.slot_to_expert
    slot_load = np.take_along_axis(load / placement.replica_count, table, axis=1)
    offsets = np.cumsum((0,) + placement.slots_per_rank[:-1])
    return np.add.reduceat(slot_load, offsets, axis=1)  # [num_layers, num_ranks]


def imbalance(load: np.ndarray, placement: Placement) -> np.ndarray:
    """[num_layers]: max rank load / mean rank load (1.0 is perfect; 1.0 for an idle layer)."""
    return _max_over_mean(rank_load(load, placement))


def compute_placement(load: np.ndarray, num_ranks: int, num_redundant: int,
                      slots_per_rank: int | tuple[int, ...] | None = None,
                      previous: Placement | None = None,
                      move_tolerance: float = 0.01) -> Placement:
    """A placement of `num_experts + num_redundant` replicas that balances `load` over ranks.

    load: [num_layers, num_experts] tokens per expert (any non-negative numbers).
    slots_per_rank: None spreads the slots evenly (see module docstring); an int must satisfy
      `num_ranks * slots_per_rank == num_experts + num_redundant`; a tuple gives each rank's
      budget and must sum to that. Budgets are met exactly.
    previous: the placement in service (ignored unless shape and budgets match). A warm start
      from it is kept when its maximum rank load is within `move_tolerance` (relative) of a
      fresh packing's; otherwise the fresh packing's ranks and slots are renumbered to keep as
      many experts in place as possible. Either way fewer weights move.

    Deterministic. Per layer the maximum rank load is never above the identity placement's
    for the same load (when the budgets can hold the identity layout), and replicas of one
    expert share a rank only when no other arrangement is found.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] < 1:
        raise ValueError(f"load must be [num_layers, num_experts], got {load.shape}")
    if num_redundant < 0 or move_tolerance < 0:
        raise ValueError("num_redundant and move_tolerance must be non-negative")
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError("load must be non-negative and finite")
    num_experts = load.shape[1]
    budgets = _budgets(num_experts + num_redundant, num_ranks, slots_per_rank)
    if previous is not None and (previous.slots_per_rank != budgets
                                 or previous.num_experts != num_experts
                                 or previous.num_layers != load.shape[0]):
        previous = None
    rows = [packing.balance_layer(layer_load, budgets,
                                  None if previous is None else previous.slot_to_expert[layer],
                                  move_tolerance)
            for layer, layer_load in enumerate(load)]
    return Placement(np.stack(rows), num_experts, budgets)


def route(expert_ids: np.ndarray, placement: Placement, layer: int,
          replica_load: np.ndarray) -> np.ndarray:
    """Slot ids for routed tokens: each (token, expert) goes to that expert's least-loaded replica.

    expert_ids: int array of any shape (e.g. [num_tokens, top_k]); read in C order, as if
      tokens arrived one by one. replica_load: [num_slots] tokens already on each slot of
      this layer; updated in place so successive calls keep balancing. Ties go to the lowest
      slot id. Returns an array shaped like `expert_ids`.
    """
    expert_ids = np.asarray(expert_ids)
    flat = expert_ids.reshape(-1)
    if replica_load.shape != (placement.num_slots,):
        raise ValueError(f"replica_load must be [{placement.num_slots}], got {replica_load.shape}")
    if flat.size and (flat.min() < 0 or flat.max() >= placement.num_experts):
        raise ValueError("expert id out of range")
    slot_ids = np.empty(flat.shape, dtype=np.int64)
    counts = placement.replica_count[layer]
    order = np.argsort(flat, kind="stable")  # grouped by expert, arrival order kept
    experts, starts = np.unique(flat[order], return_index=True)
    for expert, positions in zip(experts, np.split(order, starts[1:])):
        slots = placement.expert_to_slots[layer, expert, :counts[expert]]
        picks = _water_fill(replica_load[slots], positions.size)
        slot_ids[positions] = slots[picks]
        np.add.at(replica_load, slots[picks], 1)
    return slot_ids.reshape(expert_ids.shape)


def moves(old: Placement, new: Placement) -> list[Move]:
    """The weight copies that turn `old` into `new`: every slot whose expert changes."""
    if old.slot_to_expert.shape != new.slot_to_expert.shape:
        raise ValueError("placements have different shapes")
    layers, slots = np.nonzero(old.slot_to_expert != new.slot_to_expert)
    return [Move(int(layer), int(slot), int(new.slot_to_expert[layer, slot]))
            for layer, slot in zip(layers, slots)]


def moved_bytes(old: Placement, new: Placement, bytes_per_expert: int) -> int:
    """Bytes of expert weights copied to go from `old` to `new` (one expert per changed slot)."""
    return len(moves(old, new)) * int(bytes_per_expert)


# --- helpers ---------------------------------------------------------------------------------

def _budgets(num_slots: int, num_ranks: int,
             slots_per_rank: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if slots_per_rank is None:
        return even_slot_budget(num_slots, num_ranks)
    if isinstance(slots_per_rank, (int, np.integer)):
        if num_ranks * int(slots_per_rank) != num_slots:
            raise ValueError(f"num_ranks * slots_per_rank = {num_ranks} * {slots_per_rank} "
                             f"!= num_experts + num_redundant = {num_slots}")
        return (int(slots_per_rank),) * num_ranks
    budgets = tuple(int(s) for s in slots_per_rank)
    if len(budgets) != num_ranks or sum(budgets) != num_slots or min(budgets) < 1:
        raise ValueError(f"slots_per_rank {budgets} must give {num_ranks} ranks at least one "
                         f"slot each, {num_slots} in all")
    return budgets


def _check_load(load, num_layers: int, num_experts: int) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.ndim == 1:
        load = load[None, :]
    if load.shape != (num_layers, num_experts):
        raise ValueError(f"load must be [{num_layers}, {num_experts}], got {load.shape}")
    return load


def _max_over_mean(rank_loads: np.ndarray) -> np.ndarray:
    mean = rank_loads.mean(axis=-1)
    peak = rank_loads.max(axis=-1)
    return np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)


def _water_fill(loads: np.ndarray, num_picks: int) -> np.ndarray:
    """Indices into `loads` picked by `num_picks` greedy least-loaded choices (ties: lowest
    index), each pick adding 1. Pick k is the k-th smallest (level, index) pair over levels
    loads[i] + m, m >= 0."""
    levels = loads[:, None] + np.arange(num_picks)[None, :]  # [num_replicas, num_picks]
    index = np.broadcast_to(np.arange(loads.size)[:, None], levels.shape)
    order = np.lexsort((index.ravel(), levels.ravel()))[:num_picks]
    return index.ravel()[order]


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array

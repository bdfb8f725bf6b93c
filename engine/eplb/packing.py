"""The balancing algorithm for one layer, on plain arrays: replicate, pack, refine.

Owns nothing between calls; `placement.compute_placement` runs it per layer. Terms:

* item: one replica of one expert; it carries `load[expert] / replicas[expert]` tokens.
* budget: the number of slots a rank has; every rank ends with exactly its budget of items.
* row: `slot_to_expert` for one layer, ranks owning contiguous slot ranges in rank order.

Steps (the global policy DeepSeek describes for EPLB, plus a local search):
1. replicate: each redundant slot goes to the expert whose per-replica load is highest.
2. pack: heaviest item first, onto a free rank chosen by a packing rule; never two replicas of
   one expert on a rank while another rank with a free slot lacks it.
3. spread: swap away any duplicate the packing could not avoid.
4. refine: swap items between the heaviest rank and any other while that lowers the larger of
   the two loads below the current maximum.

With a previous row, a warm start (keep every replica that can stay, re-place only what the
new replica counts change, then refine) competes with the fresh packing and wins unless the
fresh one is better by more than `move_tolerance`: balance within a tolerance, far fewer bytes
moved.
"""
from __future__ import annotations

import numpy as np

EPS = 1e-9  # relative tolerance for "strictly better" when comparing float loads

# Which free rank takes the next (heaviest remaining) item. Ranks of different budgets make
# plain least-loaded-first sensitive to its tie-break, so all three run and the best wins.
PACKING_RULES = ("least_loaded_most_free", "least_loaded_fewest_free", "most_room_per_slot")


def balance_layer(load: np.ndarray, budgets: tuple[int, ...], previous: np.ndarray | None,
                  move_tolerance: float) -> np.ndarray:
    """slot_to_expert row for one layer's `load` [num_experts] under rank `budgets`."""
    replicas = allocate_replicas(load, sum(budgets), len(budgets))
    fresh = min((_fresh(load, replicas, budgets, rule) for rule in PACKING_RULES),
                key=_Packing.peak)  # ties: the first rule
    chosen = fresh
    if previous is not None:
        warm = _warm(load, replicas, budgets, previous)
        limit = fresh.peak() * (1 + move_tolerance)
        warm.refine(stop_at=limit)
        if warm.peak() <= limit * (1 + EPS):
            chosen = warm
    chosen = _no_worse_than_identity(chosen, fresh, load, budgets)
    return chosen.row(budgets, previous, relabel=chosen is fresh)


def _no_worse_than_identity(chosen, fresh, load, budgets) -> "_Packing":
    """Guard: fall back to the fresh packing, then to the identity layout itself, if the
    chosen one's peak is above the identity placement's."""
    row = identity_row(load.size, budgets)
    if row is None:
        return chosen
    limit = identity_peak(load, len(budgets)) * (1 + EPS)
    for candidate in (chosen, fresh):
        if candidate.peak() <= limit:
            return candidate
    copies = np.bincount(row, minlength=load.size)
    return _Packing(row, np.repeat(np.arange(len(budgets)), budgets), load / copies,
                    len(budgets), "identity")


def allocate_replicas(load: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """[num_experts] replicas per expert: each extra slot goes to the highest per-replica load
    (ties: lowest id). At most `num_ranks` replicas per expert unless every expert already has
    that many, so replicas can always sit on distinct ranks."""
    replicas = np.ones(load.size, dtype=np.int64)
    for _ in range(num_slots - load.size):
        per_replica = np.where(replicas < num_ranks, load / replicas, -1.0)
        if per_replica.max() < 0:
            per_replica = load / replicas
        replicas[int(np.argmax(per_replica))] += 1
    return replicas


def identity_row(num_experts: int, budgets: tuple[int, ...]) -> np.ndarray | None:
    """Expert e on the rank of slot e under an even split of the experts, each rank filling
    its extra slots with copies of its own experts (so its rank loads equal the identity
    placement's exactly); None when the budgets cannot hold it."""
    if num_experts < len(budgets):
        return None
    base = even_split(num_experts, len(budgets))
    if any(count > budget for count, budget in zip(base, budgets)):
        return None
    row, start = [], 0
    for count, budget in zip(base, budgets):
        row.append(np.resize(np.arange(start, start + count), budget))
        start += count
    return np.concatenate(row)


def identity_peak(load: np.ndarray, num_ranks: int) -> float:
    """Largest rank load of the identity placement (no replicas)."""
    base = even_split(load.size, num_ranks)
    return float(np.add.reduceat(load, np.cumsum((0,) + base[:-1])).max())


def even_split(total: int, num_parts: int) -> tuple[int, ...]:
    """`total` split into `num_parts` near-equal counts, the first parts taking the remainder."""
    base, extra = divmod(total, num_parts)
    return tuple(base + (part < extra) for part in range(num_parts))


class _Packing:
    """Working state of one layer: the rank of every item, with rank loads and host counts
    kept in step by `swap` (the only mutator after construction)."""

    def __init__(self, item_expert, item_rank, replica_load, num_ranks, rule):
        self.rule = rule
        self.item_expert = np.asarray(item_expert, dtype=np.int64)
        self.item_rank = np.asarray(item_rank, dtype=np.int64).copy()
        self.item_load = replica_load[self.item_expert]
        self.num_experts = replica_load.size
        self.rank_loads = np.bincount(self.item_rank, weights=self.item_load,
                                      minlength=num_ranks)
        self.hosts = np.zeros((num_ranks, self.num_experts), dtype=np.int64)
        np.add.at(self.hosts, (self.item_rank, self.item_expert), 1)

    def peak(self) -> float:
        return float(self.rank_loads.max())

    def swap(self, a: int, b: int) -> None:
        """Items a and b trade ranks."""
        rank_a, rank_b = self.item_rank[a], self.item_rank[b]
        expert_a, expert_b = self.item_expert[a], self.item_expert[b]
        self.hosts[rank_a, expert_a] -= 1
        self.hosts[rank_b, expert_b] -= 1
        self.hosts[rank_a, expert_b] += 1
        self.hosts[rank_b, expert_a] += 1
        moved = self.item_load[a] - self.item_load[b]
        self.rank_loads[rank_a] -= moved
        self.rank_loads[rank_b] += moved
        self.item_rank[a], self.item_rank[b] = rank_b, rank_a

    def spread(self) -> None:
        """Swap each duplicate replica with an item elsewhere (one whose expert its rank lacks,
        on a rank lacking its expert), keeping the larger of the two rank loads lowest."""
        for item in range(self.item_expert.size):
            rank, expert = self.item_rank[item], self.item_expert[item]
            if self.hosts[rank, expert] < 2:
                continue
            ok = ((self.hosts[self.item_rank, expert] == 0)
                  & (self.hosts[rank, self.item_expert] == 0))
            candidates = np.flatnonzero(ok)
            if candidates.size == 0:
                continue  # unavoidable: every other rank already holds this expert
            delta = self.item_load[item] - self.item_load[candidates]
            worst = np.maximum(self.rank_loads[rank] - delta,
                               self.rank_loads[self.item_rank[candidates]] + delta)
            self.swap(item, int(candidates[np.argmin(worst)]))

    def refine(self, stop_at: float = 0.0) -> None:
        """While the heaviest rank is above `stop_at` and some swap with another rank lowers
        the larger of their loads below it, make the best such swap (ties: lowest items).
        Never creates a duplicate. Each swap lowers the sorted load vector lexicographically,
        so this ends; the iteration cap only bounds the cost."""
        tolerance = EPS * max(self.peak(), 1e-300)
        for _ in range(20 * self.item_expert.size):
            heavy = int(np.argmax(self.rank_loads))
            if self.rank_loads[heavy] <= stop_at:
                return
            best = self._best_swap(heavy, tolerance)
            if best is None:
                return
            self.swap(*best)

    def _best_swap(self, heavy: int, tolerance: float) -> tuple[int, int] | None:
        mine = np.flatnonzero(self.item_rank == heavy)
        others = np.flatnonzero(self.item_rank != heavy)
        if others.size == 0:
            return None
        other_rank = self.item_rank[others]
        # delta[i, j]: load leaving the heavy rank when mine[i] and others[j] trade ranks
        delta = self.item_load[mine][:, None] - self.item_load[others][None, :]
        worst = np.maximum(self.rank_loads[heavy] - delta,
                           self.rank_loads[other_rank][None, :] + delta)
        allowed = ((self.hosts[heavy, self.item_expert[others]] == 0)[None, :]
                   & (self.hosts[other_rank[None, :], self.item_expert[mine][:, None]] == 0)
                   & (delta > tolerance))
        worst = np.where(allowed, worst, np.inf)
        i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if not worst[i, j] < self.rank_loads[heavy] - tolerance:
            return None
        return int(mine[i]), int(others[j])

    def row(self, budgets, previous, relabel: bool) -> np.ndarray:
        """slot_to_expert row. With `previous`: when `relabel`, ranks of equal budget are first
        renumbered to overlap it most (greedy matching); then experts keep their old slots
        where they can. Otherwise each rank lists its experts in ascending order."""
        offsets = np.cumsum((0,) + tuple(budgets))
        if previous is None:
            return np.concatenate([np.repeat(np.arange(self.num_experts), self.hosts[rank])
                                   for rank in range(len(budgets))])
        old_hosts = _hosts_of_row(previous, budgets, self.num_experts)
        label = _match_ranks(self.hosts, old_hosts, budgets) if relabel else \
            np.arange(len(budgets))
        row = np.empty(offsets[-1], dtype=np.int64)
        for rank, target in enumerate(label):
            span = slice(offsets[target], offsets[target + 1])
            row[span] = _keep_in_place(self.hosts[rank], previous[span])
        return row


def _fresh(load, replicas, budgets, rule) -> _Packing:
    item_expert = np.repeat(np.arange(load.size), replicas)
    replica_load = load / replicas
    item_rank = _pack(item_expert, replica_load[item_expert], budgets, load.size, rule)
    packing = _Packing(item_expert, item_rank, replica_load, len(budgets), rule)
    packing.spread()
    packing.refine()
    return packing


def _pack(item_expert, item_load, budgets, num_experts, rule) -> np.ndarray:
    """Rank of each item, heaviest first, chosen by `rule` among ranks with a free slot that
    lack the item's expert (all free ranks if every one has it). Ties: lower rank."""
    free = np.array(budgets, dtype=np.int64)
    rank_loads = np.zeros(len(budgets))
    target = item_load.sum() / len(budgets)  # mean rank load
    hosts = np.zeros((len(budgets), num_experts), dtype=np.int64)
    item_rank = np.empty(item_expert.size, dtype=np.int64)
    for item in np.lexsort((item_expert, -item_load)):
        expert = item_expert[item]
        eligible = np.flatnonzero((free > 0) & (hosts[:, expert] == 0))
        if eligible.size == 0:
            eligible = np.flatnonzero(free > 0)
        if rule == "least_loaded_most_free":
            keys = (eligible, -free[eligible], rank_loads[eligible])
        elif rule == "least_loaded_fewest_free":
            keys = (eligible, free[eligible], rank_loads[eligible])
        else:  # most room left under the mean, per free slot
            keys = (eligible, (rank_loads[eligible] - target) / free[eligible])
        best = eligible[np.lexsort(keys)[0]]
        item_rank[item] = best
        free[best] -= 1
        rank_loads[best] += item_load[item]
        hosts[best, expert] += 1
    return item_rank


def _warm(load, replicas, budgets, previous) -> _Packing:
    """Start from `previous`: drop surplus replicas (from the heaviest ranks first), put the
    missing ones into the freed slots (heaviest first, least-loaded rank lacking the expert),
    then spread. The caller refines."""
    slot_rank = np.repeat(np.arange(len(budgets)), budgets)
    row = np.asarray(previous, dtype=np.int64).copy()
    replica_load = load / replicas
    rank_loads = np.bincount(slot_rank, weights=replica_load[row], minlength=len(budgets))
    surplus = np.bincount(row, minlength=load.size) - replicas
    freed = []
    for slot in np.lexsort((np.arange(row.size), -rank_loads[slot_rank])):
        if surplus[row[slot]] > 0:
            surplus[row[slot]] -= 1
            freed.append(slot)
    if freed:
        freed = np.array(freed)
        missing = np.repeat(np.arange(load.size), np.maximum(-surplus, 0))
        kept = np.setdiff1d(np.arange(row.size), freed)
        hosts = np.zeros((len(budgets), load.size), dtype=np.int64)
        np.add.at(hosts, (slot_rank[kept], row[kept]), 1)
        loads = np.bincount(slot_rank[kept], weights=replica_load[row[kept]],
                            minlength=len(budgets))
        open_slots = list(freed)
        for expert in missing[np.lexsort((missing, -replica_load[missing]))]:
            ranks = slot_rank[open_slots]
            lacking = hosts[ranks, expert] == 0
            pool = np.flatnonzero(lacking) if lacking.any() else np.arange(len(open_slots))
            pick = pool[np.lexsort((np.array(open_slots)[pool], loads[ranks[pool]]))[0]]
            slot = open_slots.pop(int(pick))
            row[slot] = expert
            hosts[slot_rank[slot], expert] += 1
            loads[slot_rank[slot]] += replica_load[expert]
    packing = _Packing(row, slot_rank, replica_load, len(budgets), "warm")
    packing.spread()
    return packing


def _hosts_of_row(row, budgets, num_experts) -> np.ndarray:
    hosts = np.zeros((len(budgets), num_experts), dtype=np.int64)
    np.add.at(hosts, (np.repeat(np.arange(len(budgets)), budgets), row), 1)
    return hosts


def _match_ranks(hosts, old_hosts, budgets) -> np.ndarray:
    """label[new_rank] = the old rank it becomes: pairs of equal budget, largest overlap first
    (ties: lowest new rank, then lowest old rank)."""
    num_ranks = len(budgets)
    overlap = np.minimum(hosts[:, None, :], old_hosts[None, :, :]).sum(axis=2)  # [new, old]
    same_budget = np.array(budgets)[:, None] == np.array(budgets)[None, :]
    overlap = np.where(same_budget, overlap, -1)
    label = np.full(num_ranks, -1, dtype=np.int64)
    taken = np.zeros(num_ranks, dtype=bool)
    for flat in np.lexsort((np.arange(overlap.size), -overlap.ravel())):
        new, old = divmod(int(flat), num_ranks)
        if label[new] < 0 and not taken[old] and same_budget[new, old]:
            label[new], taken[old] = old, True
    return label


def _keep_in_place(counts: np.ndarray, old_slots: np.ndarray) -> np.ndarray:
    """One rank's slots: `counts[e]` copies of each expert e, kept in an old slot of e where
    possible, the rest filling the remaining slots in ascending expert order."""
    remaining = counts.copy()
    out = np.full(old_slots.size, -1, dtype=np.int64)
    for i, expert in enumerate(old_slots):
        if remaining[expert] > 0:
            out[i] = expert
            remaining[expert] -= 1
    out[out < 0] = np.repeat(np.arange(remaining.size), remaining)
    return out

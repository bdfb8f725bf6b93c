"""Exact, hand-computed cases for engine.eplb.placement."""
import numpy as np
import pytest

from duplex.engine.eplb import (Move, Placement, compute_placement, identity_placement, imbalance,
                         moved_bytes, moves, rank_load, route)


def make_placement(rows, num_experts, slots_per_rank):
    return Placement(np.array(rows), num_experts, tuple(slots_per_rank))


def test_placement_derives_replicas_and_slots():
    p = make_placement([[0, 2, 1, 0]], 3, (2, 2))
    assert p.num_layers == 1 and p.num_slots == 4 and p.num_ranks == 2
    assert p.slot_rank.tolist() == [0, 0, 1, 1]
    assert p.replica_count.tolist() == [[2, 1, 1]]
    assert p.expert_to_slots.tolist() == [[[0, 3], [2, -1], [1, -1]]]
    assert p.rank_slots(1) == slice(2, 4)


def test_placement_is_frozen_and_validated():
    p = make_placement([[0, 1]], 2, (1, 1))
    with pytest.raises(ValueError):
        p.slot_to_expert[0, 0] = 1
    with pytest.raises(ValueError, match="not every expert"):
        make_placement([[0, 0]], 2, (1, 1))
    with pytest.raises(ValueError, match="sum to"):
        make_placement([[0, 1]], 2, (1, 2))
    assert p == make_placement([[0, 1]], 2, (1, 1)) and hash(p) == hash(p)
    assert p != make_placement([[1, 0]], 2, (1, 1))


def test_rank_load_splits_an_expert_evenly_over_its_replicas():
    p = make_placement([[0, 1, 0, 2]], 3, (2, 2))
    load = np.array([[10.0, 3.0, 1.0]])
    assert rank_load(load, p).tolist() == [[8.0, 6.0]]  # 5+3 | 5+1
    assert imbalance(load, p).tolist() == [8.0 / 7.0]
    assert imbalance(np.zeros((1, 3)), p).tolist() == [1.0]  # idle layer


def test_identity_placement():
    p = identity_placement(2, 4, 2)
    assert p.slot_to_expert.tolist() == [[0, 1, 2, 3]] * 2
    assert p.slots_per_rank == (2, 2)
    assert imbalance(np.array([[4, 3, 2, 1]] * 2), p).tolist() == [1.4, 1.4]  # 7 vs mean 5


def test_lpt_packing_without_replicas():
    # heaviest first onto the least-loaded rank: 4->r0, 3->r1, 2->r1 (3<4), 1->r0
    p = compute_placement(np.array([[4, 3, 2, 1]]), num_ranks=2, num_redundant=0)
    assert p.slot_to_expert.tolist() == [[0, 3, 1, 2]]
    assert imbalance(np.array([[4, 3, 2, 1]]), p).tolist() == [1.0]


def test_replicas_go_to_highest_per_replica_load_capped_at_num_ranks():
    # expert 0 (6) -> 2 replicas of 3; a third would share a rank, so expert 1 gets the next
    p = compute_placement(np.array([[6, 2]]), num_ranks=2, num_redundant=2)
    assert p.replica_count.tolist() == [[2, 2]]
    assert p.slot_to_expert.tolist() == [[0, 1, 0, 1]]  # ranks: {0,1} {0,1}, loads 4 | 4


def test_uneven_budgets_first_ranks_take_the_extra_slot():
    p = compute_placement(np.array([[8, 4, 2, 2]]), num_ranks=3, num_redundant=1)
    assert p.slots_per_rank == (2, 2, 1)
    assert p.replica_count.tolist() == [[2, 1, 1, 1]]
    # items 4,4 (expert 0), 4, 2, 2 on budgets 2,2,1: the best peak is 6 ({4,2} {4,2} {4})
    assert rank_load(np.array([[8, 4, 2, 2]]), p).max() == 6.0


def test_slots_per_rank_must_match_the_slot_count():
    with pytest.raises(ValueError, match="slots_per_rank"):
        compute_placement(np.ones((1, 256)), num_ranks=64, num_redundant=32, slots_per_rank=4)
    p = compute_placement(np.ones((1, 256)), num_ranks=64, num_redundant=64, slots_per_rank=5)
    assert p.slots_per_rank == (5,) * 64


def test_uniform_load_stays_perfectly_balanced_with_replicas():
    p = compute_placement(np.ones((1, 4)), num_ranks=2, num_redundant=2)
    assert p.replica_count.tolist() == [[2, 2, 1, 1]]
    assert imbalance(np.ones((1, 4)), p).tolist() == [1.0]


def test_route_picks_least_loaded_replica_lowest_slot_on_ties():
    p = make_placement([[0, 1, 0, 2]], 3, (2, 2))
    replica_load = np.array([0, 0, 0, 0])
    slots = route(np.array([[0, 1], [0, 2], [0, 1]]), p, 0, replica_load)
    assert slots.tolist() == [[0, 1], [2, 3], [0, 1]]
    assert replica_load.tolist() == [2, 2, 1, 1]
    assert route(np.array([0]), p, 0, replica_load).tolist() == [2]  # slot 2 is lighter now


def test_route_balances_replicas_within_one():
    p = compute_placement(np.array([[100, 1, 1, 1]]), num_ranks=4, num_redundant=4)
    replica_load = np.zeros(p.num_slots, dtype=np.int64)
    ids = np.random.default_rng(0).integers(0, 4, size=(999, 2))
    slots = route(ids, p, 0, replica_load)
    assert (p.slot_to_expert[0][slots] == ids).all()
    for expert in range(4):
        mine = replica_load[p.slot_to_expert[0] == expert]
        assert mine.max() - mine.min() <= 1


def test_moves_and_bytes():
    old = make_placement([[0, 1, 2, 0], [0, 1, 2, 2]], 3, (2, 2))
    new = make_placement([[0, 1, 2, 1], [0, 1, 2, 2]], 3, (2, 2))
    assert moves(old, new) == [Move(layer=0, slot=3, expert=1)]
    assert moved_bytes(old, new, bytes_per_expert=44) == 44
    assert moves(old, old) == []


def test_previous_placement_keeps_weights_in_place():
    load = np.array([[9.0, 5, 4, 3, 2, 1, 1, 1]])
    first = compute_placement(load, num_ranks=4, num_redundant=4)
    again = compute_placement(load, num_ranks=4, num_redundant=4, previous=first)
    assert again == first  # same load: nothing moves
    relabelled = Placement(np.roll(first.slot_to_expert, 3, axis=1), 8, first.slots_per_rank)
    kept = compute_placement(load, num_ranks=4, num_redundant=4, previous=relabelled)
    assert moves(relabelled, kept) == []  # same packing under other rank labels


def test_compute_placement_rejects_bad_load():
    with pytest.raises(ValueError):
        compute_placement(np.array([[1.0, -1.0]]), 1, 0)
    with pytest.raises(ValueError):
        compute_placement(np.array([1.0, 2.0]), 1, 0)

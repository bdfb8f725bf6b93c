"""Hypothesis property tests of compute_placement's invariants."""
import numpy as np
from hypothesis import assume, given, settings, strategies as st

from duplex.engine.eplb import compute_placement, identity_placement, imbalance, route


@st.composite
def layouts(draw):
    num_ranks = draw(st.integers(1, 8))
    num_experts = num_ranks * draw(st.integers(1, 6))
    num_redundant = draw(st.integers(0, 2 * num_ranks + 1))
    num_layers = draw(st.integers(1, 2))
    kind = draw(st.sampled_from(["integers", "zipf", "sparse"]))
    if kind == "integers":
        load = draw(st.lists(st.integers(0, 1000), min_size=num_layers * num_experts,
                             max_size=num_layers * num_experts))
        load = np.array(load, dtype=np.float64)
    else:
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        s = draw(st.floats(0.0, 2.0))
        load = 1.0 / np.arange(1, num_layers * num_experts + 1) ** s
        rng.shuffle(load)
        if kind == "sparse":
            load[rng.random(load.size) < 0.7] = 0.0
    return load.reshape(num_layers, num_experts), num_ranks, num_redundant


def distinct_ranks(placement, layer):
    """[num_experts]: how many different ranks hold each expert."""
    pairs = set(zip(placement.slot_rank.tolist(), placement.slot_to_expert[layer].tolist()))
    return np.bincount([expert for _, expert in pairs], minlength=placement.num_experts)


def check_invariants(placement, load, num_ranks, num_redundant):
    num_layers, num_experts = load.shape
    assert placement.slot_to_expert.shape == (num_layers, num_experts + num_redundant)
    counts = np.bincount(placement.slot_rank, minlength=num_ranks)
    assert counts.tolist() == list(placement.slots_per_rank)  # budgets met exactly
    assert max(counts) - min(counts) <= 1
    assert (placement.replica_count >= 1).all()  # every expert placed
    assert (placement.replica_count.sum(axis=1) == num_experts + num_redundant).all()
    baseline = imbalance(load, identity_placement(num_layers, num_experts, num_ranks))
    assert (imbalance(load, placement) <= baseline * (1 + 1e-9)).all()


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_invariants_fresh(case):
    load, num_ranks, num_redundant = case
    placement = compute_placement(load, num_ranks, num_redundant)
    check_invariants(placement, load, num_ranks, num_redundant)
    assert compute_placement(load, num_ranks, num_redundant) == placement  # deterministic


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_invariants_warm_start(case, seed):
    load, num_ranks, num_redundant = case
    old_load = load * np.random.default_rng(seed).uniform(0, 2, size=load.shape)
    previous = compute_placement(old_load, num_ranks, num_redundant)
    placement = compute_placement(load, num_ranks, num_redundant, previous=previous)
    check_invariants(placement, load, num_ranks, num_redundant)
    fresh = compute_placement(load, num_ranks, num_redundant)
    assert (imbalance(load, placement) <= imbalance(load, fresh) * 1.01 + 1e-9).all()


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_replicas_spread_over_distinct_ranks(case):
    """Replicas of one expert share a rank only in the identity fallback: when no spread
    arrangement is as balanced as the identity placement, that layout itself is kept (each
    rank padding its spare slots with copies of its own experts). Layouts where a rank has
    more slots than there are experts force duplicates and are left out."""
    load, num_ranks, num_redundant = case
    placement = compute_placement(load, num_ranks, num_redundant)
    assume(max(placement.slots_per_rank) <= load.shape[1])
    identity = identity_placement(1, load.shape[1], num_ranks)
    for layer in range(load.shape[0]):
        expected = np.minimum(placement.replica_count[layer], num_ranks)
        if distinct_ranks(placement, layer).tolist() != expected.tolist():
            own = identity.slot_rank[placement.slot_to_expert[layer]]
            assert (own == placement.slot_rank).all()


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_route_sends_each_token_to_a_replica_of_its_expert(case, seed):
    load, num_ranks, num_redundant = case
    placement = compute_placement(load, num_ranks, num_redundant)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, placement.num_experts, size=(int(rng.integers(0, 50)), 2))
    replica_load = np.zeros(placement.num_slots, dtype=np.int64)
    slots = route(ids, placement, 0, replica_load)
    assert slots.shape == ids.shape
    assert (placement.slot_to_expert[0][slots] == ids).all()
    assert replica_load.sum() == ids.size
    for expert in range(placement.num_experts):
        mine = replica_load[placement.slot_to_expert[0] == expert]
        assert mine.max() - mine.min() <= 1

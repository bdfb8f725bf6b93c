"""Balancer: interval, staged placement, atomic commit."""
import numpy as np
import pytest

from duplex.engine.eplb import Balancer, imbalance, moves


def feed(balancer, counts, num_steps):
    """Record `counts` [layers, experts] for `num_steps` steps; return what on_step returned."""
    results = []
    for _ in range(num_steps):
        for layer, row in enumerate(counts):
            balancer.stats.record(layer, row)
        results.append(balancer.on_step())
    return results


SKEWED = np.array([[400, 100, 50, 25, 10, 5, 5, 5]] * 2)


def test_new_placement_every_interval_then_staged_until_commit():
    balancer = Balancer(num_layers=2, num_experts=8, num_ranks=4, num_redundant=4,
                        interval_steps=3)
    initial = balancer.placement
    results = feed(balancer, SKEWED, 3)
    assert results[:2] == [None, None]
    plan = results[2]
    assert plan is not None and balancer.pending is plan
    assert balancer.placement is initial  # serving code still uses the old one
    assert moves(initial, plan)  # there is something to copy
    assert (imbalance(SKEWED, plan) < imbalance(SKEWED, initial)).all()
    assert feed(balancer, SKEWED, 6) == [None] * 6  # nothing new while one is pending
    assert balancer.commit() is plan and balancer.placement is plan
    assert balancer.pending is None


def test_interval_counts_from_the_last_plan_and_same_placement_is_not_returned():
    balancer = Balancer(num_layers=2, num_experts=8, num_ranks=4, num_redundant=4,
                        interval_steps=2)
    assert feed(balancer, SKEWED, 2)[1] is not None
    balancer.commit()
    assert feed(balancer, SKEWED, 4) == [None] * 4  # same load: the placement stays


def test_window_defaults_to_the_interval():
    balancer = Balancer(num_layers=1, num_experts=4, num_ranks=2, num_redundant=0,
                        interval_steps=5)
    assert balancer.stats.window_steps == 5
    assert Balancer(1, 4, 2, 0, interval_steps=5, window_steps=9).stats.window_steps == 9


def test_commit_without_pending_raises_and_discard_keeps_current():
    balancer = Balancer(num_layers=2, num_experts=8, num_ranks=4, num_redundant=4,
                        interval_steps=1)
    with pytest.raises(RuntimeError):
        balancer.commit()
    current = balancer.placement
    assert feed(balancer, SKEWED, 1)[0] is not None
    balancer.discard()
    assert balancer.pending is None and balancer.placement is current
    assert feed(balancer, SKEWED, 1)[0] is not None  # tries again at the next interval


def test_initial_placement_has_the_layout_and_budgets():
    balancer = Balancer(num_layers=3, num_experts=256, num_ranks=64, num_redundant=32)
    placement = balancer.placement
    assert placement.slot_to_expert.shape == (3, 288)
    assert placement.slots_per_rank == (5,) * 32 + (4,) * 32
    assert balancer.interval_steps == 3000

"""ExpertLoadStats: recording, the sliding window, rank load and imbalance."""
import numpy as np
import pytest

from duplex.engine.eplb import ExpertLoadStats, Placement


def test_window_keeps_only_the_last_closed_steps():
    stats = ExpertLoadStats(num_layers=1, num_experts=3, window_steps=2)
    stats.record(0, np.array([1, 0, 0]))
    assert stats.load().tolist() == [[0, 0, 0]]  # open step does not count yet
    stats.step()
    stats.record(0, np.array([0, 2, 0]))
    stats.step()
    assert stats.load().tolist() == [[1, 2, 0]]
    stats.record(0, np.array([0, 0, 4]))
    stats.step()  # step 0 leaves the window
    assert stats.load().tolist() == [[0, 2, 4]]
    stats.step()  # an empty step pushes step 1 out
    assert stats.load().tolist() == [[0, 0, 4]]
    assert stats.num_steps == 4 and stats.num_window_steps == 2


def test_records_accumulate_within_a_step_per_layer():
    stats = ExpertLoadStats(num_layers=2, num_experts=2, window_steps=5)
    stats.record(1, np.array([1, 2]))
    stats.record(1, np.array([3, 4]))
    stats.record(0, np.array([5, 0]))
    stats.step()
    assert stats.load().tolist() == [[5, 0], [4, 6]]
    assert stats.num_window_steps == 1


def test_window_sum_matches_brute_force_over_many_steps():
    rng = np.random.default_rng(0)
    stats = ExpertLoadStats(num_layers=2, num_experts=4, window_steps=7)
    history = []
    for _ in range(40):
        counts = rng.integers(0, 100, size=(2, 4))
        for layer in range(2):
            stats.record(layer, counts[layer])
        stats.step()
        history.append(counts)
        assert (stats.load() == np.sum(history[-7:], axis=0)).all()


def test_rank_load_and_imbalance_use_the_placement():
    stats = ExpertLoadStats(num_layers=1, num_experts=3, window_steps=4)
    stats.record(0, np.array([10, 3, 1]))
    stats.step()
    placement = Placement(np.array([[0, 1, 0, 2]]), 3, (2, 2))
    assert stats.rank_load(placement).tolist() == [[8.0, 6.0]]
    assert stats.imbalance(placement).tolist() == [8.0 / 7.0]


def test_record_rejects_bad_counts():
    stats = ExpertLoadStats(num_layers=1, num_experts=3, window_steps=1)
    with pytest.raises(ValueError):
        stats.record(0, np.array([1, 2]))
    with pytest.raises(ValueError):
        stats.record(1, np.array([1, 2, 3]))
    with pytest.raises(ValueError):
        stats.record(0, np.array([1, -1, 0]))
    with pytest.raises(ValueError):
        stats.record(0, np.array([0.5, 0, 0]))
    with pytest.raises(ValueError):
        ExpertLoadStats(1, 1, window_steps=0)

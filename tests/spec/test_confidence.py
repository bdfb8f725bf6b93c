"""Confidence head: online learning on a stream with a known acceptance law, calibration
report, JSON persistence, and the load-aware stopping rule."""
from __future__ import annotations

import numpy as np
import pytest

from duplex.engine.spec.confidence import (ConfidenceHead, best_uniform_length, choose_lengths,
                                    make_features)
from duplex.engine.cost_model import CostModel

TRUE_WEIGHTS = np.array([-1.0, 4.0, -1.0, -2.0, 1.5, -1.0, -0.5, 1.0])


def _stream(seed: int, num: int):
    rng = np.random.default_rng(seed)
    x = make_features(rng.uniform(size=num), rng.uniform(0, 5, size=num),
                      rng.integers(0, 8, size=num), rng.integers(0, 9, size=num),
                      rng.uniform(size=num))
    p = 1 / (1 + np.exp(-x @ TRUE_WEIGHTS))
    return x, rng.uniform(size=num) < p, p


def _log_loss(p, y):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def test_online_updates_learn_the_acceptance_law():
    x, y, p_true = _stream(0, 6000)
    head = ConfidenceHead()
    early_predictions = head.predict(x[:1000])
    for start in range(0, len(y), 6):  # batches the size of a verification round
        head.update(x[start:start + 6], y[start:start + 6])
    x_test, y_test, p_test = _stream(1, 4000)
    before = _log_loss(early_predictions, y[:1000])
    after = _log_loss(head.predict(x_test), y_test)
    oracle = _log_loss(p_test, y_test)
    assert after < before - 0.1, (before, after)
    assert after < oracle + 0.03, (after, oracle)
    report = head.calibration.report()
    assert report["num"] == 6000 and report["ece"] < 0.05
    assert sum(b["count"] for b in report["bins"]) == 6000


def test_calibration_report_scores_predictions():
    head = ConfidenceHead()
    head.calibration.record(np.array([0.9, 0.9, 0.1, 0.1]), np.array([1, 0, 0, 0]))
    report = head.calibration.report()
    assert report["brier"] == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    assert report["log_loss"] == pytest.approx(-(np.log(0.9) + np.log(0.1) + 2 * np.log(0.9)) / 4)
    assert [(b["count"], b["observed"]) for b in report["bins"]] == [(2, 0.0), (2, 0.5)]
    assert report["ece"] == pytest.approx((2 * 0.1 + 2 * 0.4) / 4)


def test_save_and_load_round_trip(tmp_path):
    x, y, _ = _stream(2, 300)
    head = ConfidenceHead()
    head.update(x, y)
    path = tmp_path / "head.json"
    head.save(path)
    assert path.read_text().startswith("{")
    loaded = ConfidenceHead.load(path)
    np.testing.assert_array_equal(loaded.predict(x), head.predict(x))
    with pytest.raises(ValueError):
        ConfidenceHead.from_json(dict(loaded.to_json(), features=["bias"]))


def _curve(num_tokens, costs):
    model = CostModel()
    model.seed_forward_costs(num_tokens, costs)
    return model.relative_cost


def _line(token_cost: float):
    model = CostModel()
    model.seed_token_cost(token_cost)
    return model.relative_cost


def test_choose_lengths_keeps_drafts_that_pay_for_their_verification():
    line = _line(0.1)  # cost(n) = (1 + 0.1 n) / 1.1
    # one stream, cheap tokens: keep while survival beats token_cost x tokens-per-cost
    assert choose_lengths([[0.9, 0.8, 0.7, 0.05]], line) == [3]
    # two streams: the long confident run is kept, the doubtful one dropped
    assert choose_lengths([[0.95, 0.9, 0.85], [0.1, 0.01]], line) == [3, 0]
    # a compute-bound batch: no coin-flip draft is worth verifying
    assert choose_lengths([[0.5, 0.25]] * 32, _line(0.2)) == [0] * 32
    assert choose_lengths([], line) == []


def test_choose_lengths_looks_past_a_jump_in_the_cost_curve():
    # a second row costs 60 % more (a CPU BLAS leaving its one-row path), later rows 5 %:
    # one draft never pays, four likely ones do
    jump = _curve([1, 2, 5, 9], [1.0, 1.6, 1.75, 1.95])
    assert choose_lengths([[0.5]], jump) == [0]
    assert choose_lengths([[0.95, 0.9, 0.85, 0.8]], jump) == [4]
    assert jump(2) == pytest.approx(1.6) and jump(13) == pytest.approx(2.15)


def test_best_uniform_length_switches_off_under_load():
    survival = np.cumprod([0.8] * 5)
    line = _line(0.12)
    assert best_uniform_length(survival, 1, 0, line) == 5
    assert best_uniform_length(np.cumprod([0.6] * 5), 32, 0, line) == 0
    assert best_uniform_length(survival, 0, 4, line) == 0
    # an expensive drafter shortens the run
    assert best_uniform_length(survival, 1, 0, line, draft_cost=0.3) < 5

"""Confidence head: a small online logistic regression predicting that a draft token will
be accepted, its calibration report, and the stopping rule that turns predictions into
draft lengths.

Features (one row per draft token, `make_features`), all known to the drafter before
verification:

    | name              | model drafter (self / draft)  | n-gram drafter                      |
    |-------------------|-------------------------------|-------------------------------------|
    | draft_prob        | q(d_j), the drafter's prob    | share of earlier matches followed   |
    |                   |                               | by d_1 (same value for every j)     |
    | draft_entropy     | entropy of q_j, nats / 5      | 0                                   |
    | position          | j / 8 (j = 0 for d_1)         | j / 8                               |
    | match_len         | 0                             | matched suffix length / 8           |
    | unigram_match     | 0                             | 1 if the match is one token long    |
    | bigram_match      | 0                             | 1 if the match is two tokens long   |
    | recent_acceptance | the request's acceptance EMA  | the request's acceptance EMA        |

The head models the *conditional* probability that d_j is accepted given d_1..d_{j-1}
were, so it is trained only on positions verification reached (accepted ones, and the
first rejected one). The survival of a run is the product of the conditionals.

Learning is an online Newton step: the precision matrix A accumulates x x^T p (1 - p)
(with exponential forgetting, so the head tracks a changing workload, and a ridge prior
that keeps A invertible); each batch moves the weights by A^-1 times the log-loss
gradient. Newton steps are invariant to feature scaling, so the fixed scalings above only
matter for the prior. State is saved as JSON (never pickle).

Stopping rule. A step costs step_cost(tokens in it) (CostModel.relative_cost: measured at
start-up, relative to a one-token step); it yields, per decoding request, 1 token plus the survival probability
of each kept draft. `choose_lengths` keeps the drafts that maximise expected tokens per
unit of cost. Where the cost is linear (fixed part 1, token_cost per token) that is the
same as keeping a draft exactly when its survival exceeds token_cost x (the best
achievable tokens / cost): under light load the threshold is low and long runs are
verified; when the batch is compute-bound it nears 1 and drafting switches itself off.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

FEATURES = ("bias", "draft_prob", "draft_entropy", "position", "match_len", "unigram_match",
            "bigram_match", "recent_acceptance")
NUM_FEATURES = len(FEATURES)
_FORMAT_VERSION = 1
_EPS = 1e-6


def make_features(draft_prob, draft_entropy, position, match_len,
                  recent_acceptance) -> np.ndarray:
    """Feature rows [n, NUM_FEATURES]; each argument is a scalar or an array of length n.
    A short match is far less reliable than its length suggests (a single common token
    recurs everywhere), hence its own indicators besides the length."""
    match_len = np.asarray(match_len, dtype=np.float64)
    cols = np.broadcast_arrays(np.ones(1), np.asarray(draft_prob, dtype=np.float64),
                               np.asarray(draft_entropy, dtype=np.float64) / 5.0,
                               np.asarray(position, dtype=np.float64) / 8.0,
                               np.minimum(match_len, 8.0) / 8.0, (match_len == 1) * 1.0,
                               (match_len == 2) * 1.0,
                               np.asarray(recent_acceptance, dtype=np.float64))
    return np.stack(cols, axis=-1).reshape(-1, NUM_FEATURES)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


class Calibration:
    """Prequential calibration: each prediction is scored before the head learns from it."""

    def __init__(self, num_bins: int = 10) -> None:
        self.num_bins = num_bins
        self.count = np.zeros(num_bins)
        self.sum_pred = np.zeros(num_bins)
        self.sum_true = np.zeros(num_bins)
        self.log_loss_sum = 0.0
        self.brier_sum = 0.0
        self.num = 0

    def record(self, predicted: np.ndarray, accepted: np.ndarray) -> None:
        p = np.clip(predicted, _EPS, 1 - _EPS)
        y = accepted.astype(np.float64)
        bins = np.minimum((p * self.num_bins).astype(int), self.num_bins - 1)
        np.add.at(self.count, bins, 1)
        np.add.at(self.sum_pred, bins, p)
        np.add.at(self.sum_true, bins, y)
        self.log_loss_sum += float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).sum())
        self.brier_sum += float(((p - y) ** 2).sum())
        self.num += len(y)

    def report(self) -> dict:
        """log_loss, brier, ece (expected calibration error) and the reliability bins
        (mean prediction vs observed acceptance, per bin with samples)."""
        n = max(self.num, 1)
        seen = self.count > 0
        mean_pred = np.where(seen, self.sum_pred / np.maximum(self.count, 1), 0.0)
        mean_true = np.where(seen, self.sum_true / np.maximum(self.count, 1), 0.0)
        ece = float((self.count * np.abs(mean_pred - mean_true)).sum() / n)
        bins = [dict(low=i / self.num_bins, high=(i + 1) / self.num_bins, count=int(self.count[i]),
                     mean_predicted=float(mean_pred[i]), observed=float(mean_true[i]))
                for i in range(self.num_bins) if seen[i]]
        return dict(num=self.num, log_loss=self.log_loss_sum / n, brier=self.brier_sum / n,
                    ece=ece, bins=bins)


class ConfidenceHead:
    def __init__(self, prior_precision: float = 1.0, forget: float = 0.995,
                 prior_acceptance: float = 0.5) -> None:
        assert 0.0 < forget <= 1.0, "forget must be in (0, 1]"
        self.prior_precision = prior_precision
        self.forget = forget
        self.weights = np.zeros(NUM_FEATURES)
        self.weights[0] = math.log(prior_acceptance / (1.0 - prior_acceptance))
        self.precision = prior_precision * np.eye(NUM_FEATURES)  # A
        self.calibration = Calibration()

    def predict(self, features: np.ndarray) -> np.ndarray:
        """P(accepted | the drafts before it were) for each feature row [n, NUM_FEATURES]."""
        return _sigmoid(np.atleast_2d(features) @ self.weights)

    def update(self, features: np.ndarray, accepted: Sequence[bool] | np.ndarray) -> None:
        """Learn from verified draft tokens (rows that verification reached)."""
        x = np.atleast_2d(np.asarray(features, dtype=np.float64))
        y = np.asarray(accepted, dtype=np.float64).reshape(-1)
        if not len(y):
            return
        p = self.predict(x)
        self.calibration.record(p, y)
        curvature = np.maximum(p * (1 - p), 0.01)  # a floor keeps confident rows informative
        decay = self.forget ** len(y)
        self.precision = decay * self.precision \
            + (1 - decay) * self.prior_precision * np.eye(NUM_FEATURES) \
            + (x * curvature[:, None]).T @ x
        gradient = x.T @ (p - y)
        self.weights -= np.linalg.solve(self.precision, gradient)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict:
        return dict(version=_FORMAT_VERSION, features=list(FEATURES),
                    weights=self.weights.tolist(), precision=self.precision.tolist(),
                    prior_precision=self.prior_precision, forget=self.forget)

    @classmethod
    def from_json(cls, data: dict) -> ConfidenceHead:
        if data.get("version") != _FORMAT_VERSION or tuple(data.get("features", ())) != FEATURES:
            raise ValueError("confidence head state of another version or feature set")
        head = cls(prior_precision=float(data["prior_precision"]), forget=float(data["forget"]))
        head.weights = np.asarray(data["weights"], dtype=np.float64).reshape(NUM_FEATURES)
        head.precision = np.asarray(data["precision"], dtype=np.float64).reshape(
            NUM_FEATURES, NUM_FEATURES)
        return head

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> ConfidenceHead:
        return cls.from_json(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------- stopping rule
StepCostFn = Callable[[float], float]  # tokens in a forward -> its cost (CostModel.relative_cost)


def choose_lengths(survival: Sequence[Sequence[float]], step_cost: StepCostFn) -> list[int]:
    """Draft lengths for one step that maximise expected tokens per unit of step cost.

    survival[r][j]: P(drafts 1..j+1 of request r are all accepted), non-increasing in j.
    Value: per request 1 token + the survival of each kept draft; cost: step_cost(one
    token per request + kept drafts). For any number m of kept drafts the m most likely
    to survive are the most valuable (and, taken in that order, each request keeps a
    prefix of its run), so scanning m over that order finds the optimum even when the
    cost curve is not convex."""
    num_reqs = len(survival)
    if not num_reqs:
        return []
    flat = [(-float(s), j, r) for r, row in enumerate(survival) for j, s in enumerate(row)]
    flat.sort()  # highest survival first; within a request, shorter runs first
    value = float(num_reqs)
    best_ratio, best_num = value / step_cost(num_reqs), 0
    for i, (neg_s, _, _) in enumerate(flat, start=1):
        value -= neg_s
        ratio = value / step_cost(num_reqs + i)
        if ratio > best_ratio:
            best_ratio, best_num = ratio, i
    lengths = [0] * num_reqs
    for _, _, r in flat[:best_num]:
        lengths[r] += 1
    return lengths


def best_uniform_length(survival: Sequence[float], num_drafting: int, num_other: int,
                        step_cost: StepCostFn, draft_cost: float = 0.0) -> int:
    """One draft length k for all num_drafting requests (fixed-length drafting) that
    maximises expected tokens per cost, next to num_other decoding requests without
    drafts. survival[j] as in choose_lengths, shared by all requests. draft_cost: one draft
    forward's cost as a share of the target's forward over the same tokens (0: n-gram)."""
    best_k, best_ratio, gain = 0, -1.0, 0.0
    for k in range(len(survival) + 1):
        if k:
            gain += survival[k - 1]
        value = num_drafting * (1.0 + gain) + num_other
        cost = step_cost(num_other + num_drafting * (1 + k)) + \
            k * draft_cost * step_cost(num_drafting)
        if value / cost > best_ratio * (1 + 1e-9):
            best_k, best_ratio = k, value / cost
    return best_k


def keep_drafting_threshold(value: float, cost: float, token_cost: float,
                            draft_share: float) -> float:
    """Survival below which drafting one more token for a request does not pay: the token
    costs token_cost to verify plus draft_share (its share of one more draft forward) and
    must earn at least the step's current tokens-per-cost ratio value / cost."""
    return (token_cost + draft_share) * value / cost

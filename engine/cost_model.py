"""CostModel: a step's wall time predicted from what the step computes, fitted online.

    step_s ≈ c_prefill · prefill_tokens + c_attend · attended_ktokens + c_decode · decode_seqs
             + c_step

    prefill_tokens   tokens of prompts (or of resumed outputs) computed in the step
    attended_ktokens thousands of (query, key) pairs attention reads: a token at position i
                     attends to i + 1 keys, so a chunk of n tokens after c computed ones
                     reads n·c + n(n+1)/2
    decode_seqs      requests producing their next token (one query each)

The coefficients are refitted by least squares over the latest `window` measured steps,
non-negative (a feature whose coefficient would go negative is dropped from that fit), so a
worker that never prefills simply keeps c_prefill at 0. Each step is predicted before it is
observed; the median relative error of those predictions says how far to trust the model.

It also holds what one forward over n rows costs relative to a forward over one row, the
curve speculation weighs draft lengths with (engine/spec/confidence.py). That curve is seeded
at start-up, measured (engine/spec/speculator.py) or a line 1 + token_cost x n, and not taken
from the linear fit: on a CPU it is not even monotone (with one thread 2 or 3 rows cost more
than 5: the BLAS takes a row-by-row path, then a packed GEMM whose packing is itself a cost).

    relative_cost(n): piecewise linear through the seeded points (n_i, t(n_i) / t(1)),
                      extended along the last segment's slope past the last point.

Owns only numbers; the scheduler asks it through `engine.step_policy`, speculation through
`relative_cost`, the planner (`duplex plan`) through `predict` and the JSON of `to_dict`.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple, Sequence

import numpy as np

from duplex.engine.stats import CostStats

NAMES = ("prefill_token_s", "attended_ktoken_s", "decode_seq_s", "step_s")
MIN_SAMPLES = 8  # fewer measured steps: the model abstains (predict -> None)
RIDGE = 0.01  # weight of the tie-breaking penalty, relative to the number of samples
_DECODE = NAMES.index("decode_seq_s")


class StepFeatures(NamedTuple):
    num_prefill_tokens: int
    attended_ktokens: float
    num_decode_seqs: int

    def vector(self) -> list[float]:
        return [float(self.num_prefill_tokens), self.attended_ktokens,
                float(self.num_decode_seqs), 1.0]


def attended_pairs(num_computed: int, num_new: int) -> int:
    """(query, key) pairs of a chunk of num_new tokens after num_computed cached ones."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


def step_features(scheduled: Sequence) -> StepFeatures:
    """Features of a scheduled step (ScheduledRequest pairs), read BEFORE the step advances
    the requests. A request whose only missing token is its last one decodes; its draft
    tokens, if any, count as prefill tokens."""
    num_prefill, pairs, num_decode = 0, 0, 0
    for req, num_new in scheduled:
        start = req.num_computed_tokens
        pairs += attended_pairs(start, num_new)
        if req.is_decoding:
            num_decode += 1
            num_prefill += num_new - 1
        else:
            num_prefill += num_new
    return StepFeatures(num_prefill, pairs / 1000.0, num_decode)


REFIT_EVERY = 16  # observed steps between fits when nobody asks (a fit is ~0.3 ms)


class CostModel:
    def __init__(self, window: int = 256, coef: Sequence[float] | None = None) -> None:
        self._xs: deque[list[float]] = deque(maxlen=window)
        self._ys: deque[float] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=window)
        self._coef = np.zeros(len(NAMES)) if coef is None else np.asarray(coef, dtype=float)
        self.is_fitted = coef is not None
        self.num_samples = 0
        self._unfitted = 0  # samples observed since the last fit
        self._forward_tokens = np.zeros(0)  # the seeded forward-cost curve (rows, x cost(1))
        self._forward_costs = np.zeros(0)
        self._forward_slope = 0.0

    @property
    def coef(self) -> np.ndarray:
        """The coefficients over the latest window, refitted when read after new samples
        (a decode-only step asks nothing of the model, so it pays for no fit)."""
        if self._unfitted:
            self._refit()
        return self._coef

    def _refit(self) -> None:
        self._coef = _fit_non_negative(np.array(self._xs), np.array(self._ys))
        self._unfitted = 0

    # ------------------------------------------------------------------ learning
    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Record one measured step: score the prediction of the last fit made before it.
        Refitting waits for the next reader of `coef`, or for REFIT_EVERY new samples."""
        if seconds <= 0:
            return
        vector = features.vector()
        if self._unfitted >= REFIT_EVERY:
            self._refit()
        if self.is_fitted:
            predicted = float(np.dot(self._coef, vector))
            self._errors.append(abs(predicted - seconds) / seconds)
        self._xs.append(vector)
        self._ys.append(seconds)
        self.num_samples += 1
        if len(self._ys) >= MIN_SAMPLES:
            self._unfitted += 1
            self.is_fitted = True

    # ------------------------------------------------------------------ asking
    def predict(self, features: StepFeatures) -> float | None:
        """Predicted seconds of a step, or None before the model has enough samples."""
        if not self.is_fitted:
            return None
        return float(np.dot(self.coef, features.vector()))

    def max_prefill_tokens(self, budget_s: float, *, num_decode_seqs: int = 0,
                           decode_ktokens: float = 0.0, prefill_offset: int = 0,
                           limit: int) -> int | None:
        """Most prompt tokens (one chunk starting after prefill_offset computed tokens) that
        fit in budget_s next to the decode work; None when the model cannot tell (not
        fitted, or it sees no cost in prefill tokens)."""
        c_prefill, c_attend = self.coef[0], self.coef[1]
        if not self.is_fitted or c_prefill <= 0 and c_attend <= 0:
            return None

        def cost(n: int) -> float:
            return self.predict(StepFeatures(
                n, decode_ktokens + attended_pairs(prefill_offset, n) / 1000.0,
                num_decode_seqs))

        lo, hi = 0, max(0, limit)  # invariant: cost(lo) fits (or lo == 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------------ forward sizes
    def seed_forward_costs(self, num_tokens: Sequence[int], seconds: Sequence[float]) -> None:
        """Seed the forward-cost curve: measured seconds of forwards over num_tokens rows,
        from one row on (replaces an earlier seed)."""
        assert len(num_tokens) >= 2 and num_tokens[0] == 1, "points from n = 1 on"
        self._forward_tokens = np.asarray(num_tokens, dtype=np.float64)
        self._forward_costs = np.asarray(seconds, dtype=np.float64) / seconds[0]
        self._forward_slope = float((self._forward_costs[-1] - self._forward_costs[-2]) /
                                    (self._forward_tokens[-1] - self._forward_tokens[-2]))

    def seed_token_cost(self, token_cost: float) -> None:
        """Seed the curve as a line: a fixed part 1 plus token_cost per row."""
        self.seed_forward_costs([1, 2], [1.0 + token_cost, 1.0 + 2 * token_cost])

    def relative_cost(self, num_tokens: float) -> float:
        """What a forward over num_tokens rows costs, as a multiple of one over one row."""
        assert len(self._forward_tokens), "seed_forward_costs or seed_token_cost first"
        if num_tokens > self._forward_tokens[-1]:
            return float(self._forward_costs[-1] +
                         self._forward_slope * (num_tokens - self._forward_tokens[-1]))
        return float(np.interp(num_tokens, self._forward_tokens, self._forward_costs))

    def forward_costs(self) -> tuple[list[float], list[float]]:
        """The seeded curve: (rows of a forward, its cost as a multiple of one row's)."""
        return [float(n) for n in self._forward_tokens], [float(c) for c in self._forward_costs]

    @property
    def median_rel_error(self) -> float:
        return statistics.median(self._errors) if self._errors else 0.0

    # ------------------------------------------------------------------ reporting
    def stats(self) -> CostStats:
        """The coefficients and fit quality, for WorkerStats (and /metrics)."""
        return CostStats(**dict(zip(NAMES, map(float, self.coef))),
                         median_rel_error=float(self.median_rel_error),
                         num_samples=float(self.num_samples))

    def to_dict(self) -> dict:
        return {"coef": dict(zip(NAMES, map(float, self.coef))),
                "median_rel_error": self.median_rel_error, "num_samples": self.num_samples}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """A fitted model from `to_dict` output (or {"coef": {...}} with NAMES as keys), or
        from /metrics-style names ("cost_prefill_token_s", ...: `duplex_worker_figure`)."""
        coef = data.get("coef", data)
        values = [float(coef.get(name, coef.get(f"cost_{name}", 0.0))) for name in NAMES]
        if not any(values):
            raise ValueError("no cost-model coefficients found")
        model = cls(coef=values)
        model.num_samples = int(data.get("num_samples", data.get("cost_num_samples", 0)))
        return model


def _fit_non_negative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the features that come out
    negative until none does (at most one pass per feature).

    A light ridge term on the per-sequence contribution settles what the data cannot tell
    apart in favour of the per-step constant: with a decode batch that hardly varies, the
    two are collinear, and the constant (reading the weights) is what a bigger batch does
    not pay again."""
    penalty = np.zeros((1, x.shape[1]))
    penalty[0, _DECODE] = np.sqrt(RIDGE * len(y) * (x[:, _DECODE] ** 2).mean())
    x, y = np.vstack([x, penalty]), np.append(y, 0.0)
    active = [j for j in range(x.shape[1]) if np.any(x[:-1, j])]
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            return coef
        active = [j for j, c in zip(active, solution) if c > 0]
    return coef

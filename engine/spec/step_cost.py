"""StepCost: what a forward over n tokens costs, relative to a forward over one token.

The stopping rule (confidence.py) weighs the survival of draft tokens against what
verifying them costs. On a GPU that cost is nearly flat until the batch turns
compute-bound; on a CPU it is not even monotone: with one thread, 2 or 3 rows cost more
than 5 (the BLAS takes a row-by-row path, then switches to a packed GEMM whose packing is
itself a cost). So the curve is measured at start-up (`measure`), or, when configured, a
plain line 1 + token_cost x n normalised to cost(1) = 1.

    cost(n):  piecewise linear through the measured points (n_i, t(n_i) / t(1)),
              extended along the last segment's slope past the last point.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class StepCost:
    def __init__(self, num_tokens: Sequence[int], costs: Sequence[float]) -> None:
        assert len(num_tokens) >= 2 and num_tokens[0] == 1, "points from n = 1 on"
        self.num_tokens = np.asarray(num_tokens, dtype=np.float64)
        self.costs = np.asarray(costs, dtype=np.float64) / costs[0]
        self.slope = float((self.costs[-1] - self.costs[-2]) /
                           (self.num_tokens[-1] - self.num_tokens[-2]))

    @classmethod
    def linear(cls, token_cost: float) -> StepCost:
        """A fixed part 1 plus token_cost per token."""
        return cls([1, 2], [1.0 + token_cost, 1.0 + 2 * token_cost])

    def __call__(self, num_tokens: float) -> float:
        if num_tokens > self.num_tokens[-1]:
            return float(self.costs[-1] + self.slope * (num_tokens - self.num_tokens[-1]))
        return float(np.interp(num_tokens, self.num_tokens, self.costs))

    def stats(self) -> tuple[list[float], list[float]]:
        """(step sizes in tokens, the cost of each, as multiples of one token's step)."""
        return [float(n) for n in self.num_tokens], [float(c) for c in self.costs]


@torch.inference_mode()
def measure(model, runner, num_free_blocks: int, repeats: int = 3,
            context: int = 64) -> StepCost:
    """Time the model on one sequence of `context` cached tokens plus n new ones, for n on
    GRID (as far as num_free_blocks allow), logits for every new row as verification
    needs; the minimum of `repeats` runs, as interference on a shared machine only adds.
    Writes KV into blocks no request owns yet (called before the first request)."""
    from engine.scheduler import ScheduledRequest
    from engine.spec.draft_model import RequestView

    grid = [n for n in GRID if -(-(context + n) // runner.block_size) <= num_free_blocks]
    times = {}
    for n in grid:
        tokens = [1] * (context + n)
        view = RequestView(tokens, list(range(-(-len(tokens) // runner.block_size))), context)
        inputs = runner.prepare([ScheduledRequest(view, n)])
        rows = list(range(n))
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.execute(inputs, rows)
            runs.append(time.perf_counter() - start)
        times[n] = min(runs)
    return StepCost(list(times), [times[n] for n in times])

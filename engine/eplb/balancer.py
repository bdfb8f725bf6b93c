"""The rebalancing policy: when to compute a new placement, and the staged switch to it.

Owns the current placement, the pending one and the load statistics. Serving code records
routed-token counts into `stats`, calls `on_step()` once per step, copies the weights of a
returned placement (see `placement.moves`) while still serving with the current one, then
calls `commit()` to switch every layer in one step.
"""
from __future__ import annotations

import numpy as np

from duplex.engine.eplb.placement import Placement, compute_placement
from duplex.engine.eplb.stats import ExpertLoadStats


class Balancer:
    """Recomputes the placement every `interval_steps` steps from the last `window_steps`.

    Contract: `placement` changes only in `commit()`. While a placement is pending no new one
    is computed (the copy in flight is never invalidated); the interval counts on from the
    step the pending placement was made.
    """

    def __init__(self, num_layers: int, num_experts: int, num_ranks: int, num_redundant: int,
                 interval_steps: int = 3000, window_steps: int | None = None,
                 slots_per_rank: int | tuple[int, ...] | None = None,
                 move_tolerance: float = 0.01):
        if interval_steps < 1:
            raise ValueError("interval_steps must be >= 1")
        self.num_ranks = num_ranks
        self.num_redundant = num_redundant
        self.interval_steps = interval_steps
        self.slots_per_rank = slots_per_rank
        self.move_tolerance = move_tolerance  # see compute_placement
        self.stats = ExpertLoadStats(num_layers, num_experts, window_steps or interval_steps)
        # Before any statistics every expert counts as equally loaded.
        self.placement: Placement = compute_placement(
            np.ones((num_layers, num_experts)), num_ranks, num_redundant, slots_per_rank)
        self.pending: Placement | None = None
        self._steps_since_plan = 0

    def on_step(self) -> Placement | None:
        """Close the statistics step; every `interval_steps` steps return a new pending
        placement (None otherwise, while one is pending, or when nothing would move)."""
        self.stats.step()
        self._steps_since_plan += 1
        if self.pending is not None or self._steps_since_plan < self.interval_steps:
            return None
        self._steps_since_plan = 0
        plan = compute_placement(self.stats.load(), self.num_ranks, self.num_redundant,
                                 self.slots_per_rank, previous=self.placement,
                                 move_tolerance=self.move_tolerance)
        if plan == self.placement:
            return None
        self.pending = plan
        return plan

    def commit(self) -> Placement:
        """Switch to the pending placement (its weights must be in place) and return it."""
        if self.pending is None:
            raise RuntimeError("commit() without a pending placement")
        self.placement, self.pending = self.pending, None
        return self.placement

    def discard(self) -> None:
        """Drop the pending placement (e.g. the weight copy failed); the current one stays."""
        self.pending = None

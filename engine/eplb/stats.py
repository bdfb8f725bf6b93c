"""Expert load statistics: tokens routed to each expert of each layer, over a sliding window.

Owns a ring buffer of the last `window_steps` closed steps plus the step being recorded. Only
closed steps count in `load()`, so a placement is always computed from whole steps.
"""
from __future__ import annotations

import numpy as np

from duplex.engine.eplb.placement import Placement, imbalance, rank_load


class ExpertLoadStats:
    """Per-step, per-layer, per-expert token counts; `load()` sums the last `window_steps`."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int):
        if min(num_layers, num_experts, window_steps) < 1:
            raise ValueError("num_layers, num_experts and window_steps must be >= 1")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window_steps = window_steps
        self._ring = np.zeros((window_steps, num_layers, num_experts), dtype=np.int64)
        self._window_sum = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._current = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.num_steps = 0  # closed steps since construction

    def record(self, layer: int, expert_counts) -> None:
        """Add this step's token counts for one layer (may be called several times per step)."""
        counts = np.asarray(expert_counts)
        if counts.shape != (self.num_experts,):
            raise ValueError(f"expert_counts must be [{self.num_experts}], got {counts.shape}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if counts.dtype.kind not in "iub" or np.any(counts < 0):
            raise ValueError("expert_counts must be non-negative integers")
        self._current[layer] += counts

    def step(self) -> None:
        """Close the current step: it enters the window and the oldest step leaves it."""
        slot = self.num_steps % self.window_steps
        self._window_sum += self._current - self._ring[slot]
        self._ring[slot] = self._current
        self._current = np.zeros_like(self._current)
        self.num_steps += 1

    @property
    def num_window_steps(self) -> int:
        """Closed steps currently inside the window."""
        return min(self.num_steps, self.window_steps)

    def load(self) -> np.ndarray:
        """[num_layers, num_experts]: tokens per expert over the window (a copy)."""
        return self._window_sum.copy()

    def rank_load(self, placement: Placement) -> np.ndarray:
        """[num_layers, num_ranks]: window tokens per rank under `placement`."""
        return rank_load(self._window_sum, placement)

    def imbalance(self, placement: Placement) -> np.ndarray:
        """[num_layers]: max rank load / mean rank load over the window under `placement`."""
        return imbalance(self._window_sum, placement)

"""`CircuitBreaker`: whether a networked store is worth calling right now.

Owns the on / off state of one remote tier. After `max_failures` consecutive failed calls
the breaker opens (the tier is off: reads are misses, writes are dropped, nothing waits on
the store) for `cooldown_s`; then one trial call is let through (half open): success closes
it, failure opens it for another cooldown. Single-threaded: one event loop drives it.
"""
from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, max_failures: int = 3, cooldown_s: float = 5.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_failures < 1 or cooldown_s <= 0:
            raise ValueError("max_failures must be >= 1 and cooldown_s > 0")
        self.max_failures = max_failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_out = False
        self.num_trips = 0  # times it opened

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        return HALF_OPEN if self._clock() - self._opened_at >= self.cooldown_s else OPEN

    @property
    def is_on(self) -> bool:
        """The tier is usable (closed), not off or waiting for its trial call."""
        return self._opened_at is None

    def allow(self) -> bool:
        """May a call go out now? In half-open state only one trial call at a time."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self._trial_out:
            self._trial_out = True
            return True
        return False

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial_out = False

    def record_failure(self) -> None:
        self._failures += 1
        if self._opened_at is not None or self._failures >= self.max_failures:
            self.trip()

    def trip(self) -> None:
        """Open now (e.g. the store was unreachable at start)."""
        if self._opened_at is None or self._trial_out:
            self.num_trips += self._opened_at is None
        self._opened_at = self._clock()
        self._trial_out = False

"""Deadlines: the one owner of request deadlines, held by the worker loop (engine/worker.py).

A request's deadline is an absolute `time.time()` set by the frontend (`AddRequest.deadline`,
0 = none). Only the worker enforces it: a request past its deadline on arrival is refused
with an error, one that passes it while running is aborted, both with `DEADLINE_ERROR`. The
core has no clock of its own for this (an expert-parallel group's ranks would disagree), and
the frontend only maps that finish to its API error (a timeout), with a last-resort cutoff
for a worker that never answers.
"""
from __future__ import annotations

import heapq
import time
from typing import Callable

DEADLINE_ERROR = "deadline exceeded"


class Deadlines:
    """The deadlines of the requests a worker admitted, earliest first."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._heap: list[tuple[float, str]] = []  # (deadline, req_id)

    def is_past(self, deadline: float) -> bool:
        """Whether a deadline (0: none) has passed already."""
        return 0 < deadline <= self._clock()

    def add(self, req_id: str, deadline: float) -> None:
        if deadline > 0:
            heapq.heappush(self._heap, (deadline, req_id))

    def pop_expired(self) -> list[str]:
        """Ids whose deadline has passed, each once (a finished one may still be among
        them: the caller ends only those still running)."""
        now, expired = self._clock(), []
        while self._heap and self._heap[0][0] <= now:
            expired.append(heapq.heappop(self._heap)[1])
        return expired

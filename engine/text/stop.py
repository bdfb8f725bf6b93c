"""Stop strings on a text stream.

Owns: the held-back tail of one output stream. Text is released as soon as no stop string can
start inside it; the tail that could still grow into a stop string waits. The first stop string
to *complete* wins (ties: the one starting earliest), so the result does not depend on how the
text was split into deltas.
"""
from __future__ import annotations


class StopChecker:
    """Cuts a text stream at the first stop string; the stop string itself is dropped unless
    `include_stop_str`."""

    def __init__(self, stop: list[str] | None, include_stop_str: bool = False):
        if isinstance(stop, str):
            stop = [stop]
        stop = stop or []
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = sorted(set(stop), key=len, reverse=True)
        self._include = include_stop_str
        self._held = ""
        self.stopped = False
        self.stop_str: str | None = None   # the stop string that was hit

    def push(self, text_delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        buffer = self._held + text_delta
        hit = self._first_hit(buffer)
        if hit is not None:
            start, stop_str = hit
            self.stopped, self.stop_str, self._held = True, stop_str, ""
            return buffer[:start + (len(stop_str) if self._include else 0)], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """End of stream: the held-back tail, which turned out not to be a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_hit(self, buffer: str) -> tuple[int, str] | None:
        best = None   # (end, start, stop)
        for stop_str in self._stops:
            start = buffer.find(stop_str)
            if start >= 0:
                candidate = (start + len(stop_str), start, stop_str)
                best = candidate if best is None or candidate[:2] < best[:2] else best
        return None if best is None else (best[1], best[2])

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of a stop string."""
        longest = len(self._stops[0]) if self._stops else 0
        for size in range(min(len(buffer), longest - 1), 0, -1):
            tail = buffer[-size:]
            if any(stop_str.startswith(tail) for stop_str in self._stops):
                return size
        return 0

"""What a client's JSON may be before a parser sees it: its nesting depth.

msgspec (like `json`) recurses once per nesting level and raises RecursionError near Python's
recursion limit, counted from wherever the caller already is on the stack. So a deep body is
refused here first, with a 400 that names the limit, at `MAX_JSON_DEPTH` levels: far below
Python's limit (1000) and far above what any API body needs (a tool's JSON Schema nests a few
levels per property).

The scan is cheap: a body with fewer opening brackets than the limit cannot be that deep and
is not scanned at all; otherwise strings are cut out with one regex (brackets inside them do
not nest) and numpy sums +1 / -1 over the remaining brackets.
"""
from __future__ import annotations

import re

import numpy as np

MAX_JSON_DEPTH = 128

# A JSON string, escapes included; the unrolled form matches in linear time.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_STEP = np.zeros(256, dtype=np.int32)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


class TooDeep(ValueError):
    """The body nests deeper than the limit."""


def check_depth(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise TooDeep if the JSON text `raw` nests arrays/objects deeper than `limit`.
    Malformed text is not judged here (the parser rejects it); it may count as deep."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= limit:  # cannot be deeper: skip the scan
        return
    if json_depth(data) > limit:
        raise TooDeep(f"JSON nested deeper than the limit of {limit} levels")


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text `data` (0: a scalar)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = _STEP[np.frombuffer(brackets, dtype=np.uint8)]
    return int(np.cumsum(steps).max())

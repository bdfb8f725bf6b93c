"""`duplex bench kv` helpers that need no server."""
from __future__ import annotations

import argparse

import pytest

from duplex.bench.kv import _hit_rate_bound


def _args(**values) -> argparse.Namespace:
    return argparse.Namespace(**{**dict(conversations=1, turns=2, system_len=10, input_len=5,
                                        output_len=3), **values})


def test_hit_rate_bound_counts_history_but_never_the_new_turn():
    # turn 1: 15 prompt tokens, none cached (the first conversation); turn 2: 23 prompt
    # tokens of which the 18 of turn 1 (prompt + answer) can be cached
    assert _hit_rate_bound(_args()) == pytest.approx(18 / 38)
    # a second conversation also hits the shared system prompt on its first turn
    assert _hit_rate_bound(_args(conversations=2)) == pytest.approx((10 + 36) / 76)


def test_hit_rate_bound_grows_with_shorter_turns():
    long_turns = _hit_rate_bound(_args(conversations=32, turns=8, system_len=512,
                                       input_len=256, output_len=32))
    short_turns = _hit_rate_bound(_args(conversations=32, turns=8, system_len=512,
                                        input_len=64, output_len=32))
    assert 0.85 < long_turns < 0.86 and 0.92 < short_turns < 0.93

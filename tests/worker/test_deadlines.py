"""duplex.engine.deadlines: earliest first, each id once, 0 means none; on a hand-set clock."""
from __future__ import annotations

from duplex.engine.deadlines import Deadlines


def test_deadlines_expire_in_order_once():
    now = [100.0]
    deadlines = Deadlines(clock=lambda: now[0])
    deadlines.add("b", 102.0)
    deadlines.add("a", 101.0)
    deadlines.add("none", 0.0)
    assert deadlines.pop_expired() == []
    now[0] = 101.0
    assert deadlines.pop_expired() == ["a"]
    now[0] = 500.0
    assert deadlines.pop_expired() == ["b"] and deadlines.pop_expired() == []


def test_is_past():
    deadlines = Deadlines(clock=lambda: 10.0)
    assert [deadlines.is_past(d) for d in (0.0, 9.0, 10.0, 11.0)] == [False, True, True, False]

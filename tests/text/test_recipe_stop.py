"""Stop strings: cut at the first stop string to complete, whatever the delta boundaries."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.engine.text.stop import StopChecker


def reference(text, stops, include):
    """Whole-text answer: the stop string that ends first (ties: starts first) cuts the text."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, False
    end, start, _ = min(hits)
    return text[:end if include else start], True


def run(deltas, stops, include=False):
    checker = StopChecker(stops, include_stop_str=include)
    emitted, hit = [], False
    for delta in deltas:
        text, hit = checker.push(delta)
        emitted.append(text)
        if hit:
            break
    if not hit:
        emitted.append(checker.flush())
    return "".join(emitted), hit


def test_stop_inside_one_delta():
    assert StopChecker(["STOP"]).push("Hello STOP world") == ("Hello ", True)


def test_stop_across_deltas_never_leaks():
    checker = StopChecker(["STOP"])
    assert checker.push("Hello ST") == ("Hello ", False)
    assert checker.push("O") == ("", False)
    assert checker.push("P and more") == ("", True)
    assert checker.push("later") == ("", True)
    assert checker.flush() == ""
    assert checker.stop_str == "STOP"


def test_include_stop_str():
    checker = StopChecker(["</answer>"], include_stop_str=True)
    assert checker.push("42</ans") == ("42", False)
    assert checker.push("wer>tail") == ("</answer>", True)


def test_false_alarm_is_released():
    checker = StopChecker(["STOP"])
    assert checker.push("ST") == ("", False)
    assert checker.push("AY") == ("STAY", False)
    assert checker.push("S") == ("", False)
    assert checker.flush() == "S"


def test_first_to_complete_wins():
    assert run(["xabc"], ["abc", "b"]) == ("xa", True)
    assert run(["xabc"], ["abc", "b"], include=True) == ("xab", True)
    assert run(["aaab"], ["aab"]) == ("a", True)
    assert run(["abcd"], ["bcd", "abcd"]) == ("", True)   # same end: the longer one


def test_holds_only_a_possible_prefix():
    checker = StopChecker(["hello", "abc"])
    assert checker.push("xyz hel") == ("xyz ", False)
    assert checker.push("lx ab") == ("hellx ", False)
    assert checker.flush() == "ab"


def test_no_stop_strings():
    for stops in (None, []):
        checker = StopChecker(stops)
        assert checker.push("abc") == ("abc", False) and checker.flush() == ""


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])


@pytest.mark.parametrize("text, stops", [
    ("The answer is 42.\nUser: next", ["\nUser:", "42."]),
    ("emoji 🙂 stop 🛑 here", ["🛑", "stop 🛑!"]),
    ("aaaaaaaaab", ["aab", "aaab"]),
    ("no stop here at all", ["STOP"]),
])
@pytest.mark.parametrize("include", [False, True])
def test_every_split_point(text, stops, include):
    expected = reference(text, stops, include)
    assert run([text], stops, include) == expected
    assert run(list(text), stops, include) == expected
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]], stops, include) == expected


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(text=st.text("abc", max_size=20), stops=st.lists(st.text("abc", min_size=1, max_size=4),
                                                        min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 20), max_size=6), include=st.booleans())
def test_random_splits_match_the_whole_text_answer(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(deltas, stops, include) == reference(text, stops, include)

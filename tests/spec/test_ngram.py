"""Prompt-lookup n-gram drafter: exact proposals on hand-made contexts, and the vectorised
search against a brute-force scan."""
from __future__ import annotations

import numpy as np
import pytest

from duplex.engine.spec.ngram import NgramDrafter, find_occurrences


def test_copies_what_followed_the_suffix():
    match = NgramDrafter(max_n=3).propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3)
    assert match.token_ids == [8, 9, 1]
    assert match.match_len == 3
    assert (match.num_occurrences, match.agreement) == (1, 1.0)


def test_prefers_the_longest_suffix_then_the_latest_occurrence():
    # "7" occurs twice (followed by 1, then 2); "6 7" only once, followed by 1
    context = [6, 7, 1, 0, 7, 2, 0, 6, 7]
    assert NgramDrafter(max_n=2).propose(context, 2).token_ids == [1, 0]
    # with single tokens only, the latest "7" wins and half the occurrences agree
    match = NgramDrafter(max_n=1).propose(context, 1)
    assert match.token_ids == [2]
    assert (match.match_len, match.num_occurrences, match.agreement) == (1, 2, 0.5)


def test_no_match_proposes_nothing():
    match = NgramDrafter(max_n=3, min_n=2).propose([1, 2, 3, 4, 5], 4)
    assert match.token_ids == [] and match.match_len == 0
    assert NgramDrafter().propose([1, 2, 1], 0).token_ids == []
    assert NgramDrafter().propose([9], 3).token_ids == []


def test_a_copy_running_into_the_end_keeps_cycling():
    # period 3: ... a b c a b | c a b c a
    assert NgramDrafter(max_n=2).propose([1, 2, 3, 1, 2], 5).token_ids == [3, 1, 2, 3, 1]
    assert NgramDrafter(max_n=4).propose([4, 4, 4, 4], 3).token_ids == [4, 4, 4]


def test_max_lookback_limits_the_search():
    context = [1, 2, 3] + [9] * 20 + [1, 2]
    assert NgramDrafter(max_n=2).propose(context, 1).token_ids == [3]
    assert NgramDrafter(max_n=2, max_lookback=10).propose(context, 1).token_ids == []


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_search_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 3, size=200)
    for n in (1, 2, 3, 5):
        suffix = list(context[-n:])
        expected = [i for i in range(len(context) - n) if list(context[i:i + n]) == suffix]
        assert find_occurrences(context, n).tolist() == expected

"""Prompt-lookup n-gram drafter: the request's own context is the draft model.

The last n tokens (n from `max_n` down to `min_n`) are looked up among earlier positions
of the context; the tokens that followed the most recent earlier occurrence are proposed.
Copy-heavy requests (edit, summarise, quote a document in the prompt) hit often and long.

    context:  ... a b c d e ........ a b c [?]
                  ^ match  ^ proposal      ^ suffix (n = 3) -> propose d e ...

The search is vectorised with numpy: for each n it compares n shifted views of the
context against the suffix, so a long context costs O(len * n) elementwise work, no
Python loop over positions.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class NgramMatch(NamedTuple):
    token_ids: list[int]  # proposed continuation (may be shorter than asked)
    match_len: int  # n of the matched suffix; 0 = no match
    num_occurrences: int  # earlier occurrences of the suffix
    agreement: float  # share of those occurrences followed by token_ids[0]


NO_MATCH = NgramMatch([], 0, 0, 0.0)


class NgramDrafter:
    cost = 0.0  # drafting costs no forward pass

    def __init__(self, max_n: int = 4, min_n: int = 1, max_lookback: int = 0) -> None:
        assert 1 <= min_n <= max_n, "need 1 <= min_n <= max_n"
        self.max_n = max_n
        self.min_n = min_n
        self.max_lookback = max_lookback  # 0: search the whole context

    def propose(self, token_ids: Sequence[int] | np.ndarray, num_tokens: int) -> NgramMatch:
        """Up to num_tokens draft tokens continuing token_ids."""
        if num_tokens <= 0:
            return NO_MATCH
        context = np.asarray(token_ids, dtype=np.int64)
        if self.max_lookback and len(context) > self.max_lookback:
            context = context[-self.max_lookback:]
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            starts = find_occurrences(context, n)
            if len(starts):
                return _continuation(context, starts, n, num_tokens)
        return NO_MATCH


def find_occurrences(context: np.ndarray, n: int) -> np.ndarray:
    """Start indices i < len - n with context[i:i+n] == context[-n:], ascending. An
    occurrence must be followed by at least one token (so the suffix itself never counts)."""
    length = len(context)
    num_starts = length - n  # candidate starts 0 .. length-n-1
    if num_starts <= 0:
        return np.empty(0, dtype=np.int64)
    suffix = context[-n:]
    hit = context[:num_starts] == suffix[0]  # [num_starts]
    for j in range(1, n):
        hit &= context[j:j + num_starts] == suffix[j]
    return np.flatnonzero(hit)


def _continuation(context: np.ndarray, starts: np.ndarray, n: int, num_tokens: int) -> NgramMatch:
    last = int(starts[-1])  # the most recent occurrence: the likeliest to be copied on
    period = len(context) - n - last  # the copy repeats what came `period` tokens earlier
    proposal = context[last + n:last + n + num_tokens].tolist()
    while len(proposal) < num_tokens:  # the copy runs into the context's end: keep cycling
        proposal.append(proposal[len(proposal) - period])
    followers = context[starts + n]  # the token after each occurrence
    agreement = float(np.mean(followers == proposal[0]))
    return NgramMatch(proposal, n, len(starts), agreement)

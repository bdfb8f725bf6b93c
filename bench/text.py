"""`TextSource`: cuts text of an exact token length out of the built-in corpus.

The corpus is laid out as a token stream (passes over the paragraphs, each pass in a seeded
order). A window of n tokens is taken only where it starts on a word (a token that begins with
a space and a letter) and the token after it starts a word too. With a byte-level BPE
tokenizer such a window is a whole number of pre-tokens, so

    encode(decode(window)) == window            (exact length), and
    encode(a + b) == encode(a) + encode(b)      for windows a and b,

which is what lets workloads build prompts of exact lengths and prefixes that stay shared
token for token. Every window is checked by re-encoding it.
"""
from __future__ import annotations

import itertools
import random
from typing import NamedTuple

from bench.corpus import PARAGRAPHS

_WORD_MARKS = ("Ġ", "▁")       # byte-level BPE and SentencePiece spellings of a leading space
_MIN_PASSES = 8
_MAX_ATTEMPTS = 64


class Window(NamedTuple):
    text: str
    token_ids: list[int]


class TextSource:
    """Owns the corpus token stream for one tokenizer and seed."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self._rng = random.Random(seed)
        self._ids: list[int] = []
        self._word_starts: list[bool] = []
        for _ in range(_MIN_PASSES):
            self._extend()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def window(self, num_tokens: int, rng: random.Random) -> Window:
        """Text of exactly `num_tokens` tokens, from a position chosen by `rng`."""
        if num_tokens < 1:
            raise ValueError(f"a text window needs at least one token, got {num_tokens}")
        while len(self._ids) < 2 * num_tokens + 2:
            self._extend()
        for _ in range(_MAX_ATTEMPTS):
            start = self._aligned_start(num_tokens, rng.randrange(len(self._ids) - num_tokens))
            if start is None:
                continue
            ids = self._ids[start:start + num_tokens]
            text = self.tokenizer.decode(ids)
            if self.encode(text) == ids:
                return Window(text, ids)
        raise RuntimeError(f"no stable {num_tokens}-token window in the corpus for this tokenizer")

    def _aligned_start(self, num_tokens: int, first: int) -> int | None:
        """First i >= first (wrapping once) where [i, i + num_tokens) is word-aligned."""
        limit = len(self._ids) - num_tokens
        for i in itertools.chain(range(first, limit), range(0, first)):
            if self._word_starts[i] and self._word_starts[i + num_tokens]:
                return i
        return None

    def _extend(self) -> None:
        order = list(PARAGRAPHS)
        self._rng.shuffle(order)
        ids = self.encode(" " + "\n\n".join(order) + "\n\n")
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        self._ids.extend(ids)
        self._word_starts.extend(_is_word_start(p) for p in pieces)


def _is_word_start(piece: str) -> bool:
    return len(piece) > 1 and piece[0] in _WORD_MARKS and piece[1].isalpha()

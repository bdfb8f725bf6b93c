"""`TextSource`: cuts text of an exact token length out of the built-in corpus.

The corpus is laid out as a token stream (passes over the paragraphs, each pass in a seeded
order). A window of n tokens is taken only where it starts on a word (a token that begins with
a space and a letter) and the token after it starts a word too. With a byte-level BPE
tokenizer such a window is a whole number of pre-tokens, so

    encode(decode(window)) == window            (exact length), and
    encode(a + b) == encode(a) + encode(b)      for windows a and b,

which is what lets workloads build prompts of exact lengths and prefixes that stay shared
token for token. Every window is checked by re-encoding it. `text` puts a few random whole
words in front of a window so that separately drawn texts never share a prefix by accident.
"""
from __future__ import annotations

import random
from typing import NamedTuple

from duplex.bench.corpus import PARAGRAPHS

_WORD_MARKS = ("Ġ", "▁")       # byte-level BPE and SentencePiece spellings of a leading space
_MIN_PASSES = 8
_MAX_ATTEMPTS = 1000
_HEAD_WORDS = 4


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
        # Whole words: a word start followed by another word start.
        self._word_ids = sorted({self._ids[i] for i in range(len(self._ids) - 1)
                                 if self._word_starts[i] and self._word_starts[i + 1]})

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def text(self, num_tokens: int, rng: random.Random) -> Window:
        """`num_tokens` tokens: a head of random whole words, then corpus prose.

        The head makes texts drawn separately differ from their first token on (the corpus
        alone has only a few thousand start positions), so unrelated prompts never share a
        prefix by accident.
        """
        head = self.words(min(_HEAD_WORDS, num_tokens), rng)
        if num_tokens == len(head.token_ids):
            return head
        body = self.window(num_tokens - len(head.token_ids), rng)
        return Window(head.text + body.text, head.token_ids + body.token_ids)

    def words(self, num_words: int, rng: random.Random) -> Window:
        """`num_words` random one-token words from the corpus (each one token, space first)."""
        ids = [rng.choice(self._word_ids) for _ in range(num_words)]
        return Window(self.tokenizer.decode(ids), ids)

    def window(self, num_tokens: int, rng: random.Random) -> Window:
        """Corpus prose of exactly `num_tokens` tokens, from a position chosen by `rng`."""
        if num_tokens < 1:
            raise ValueError(f"a text window needs at least one token, got {num_tokens}")
        while len(self._ids) < 2 * num_tokens + 2:
            self._extend()
        for _ in range(_MAX_ATTEMPTS):
            start = rng.randrange(len(self._ids) - num_tokens)
            if not (self._word_starts[start] and self._word_starts[start + num_tokens]):
                continue
            ids = self._ids[start:start + num_tokens]
            text = self.tokenizer.decode(ids)
            if self.encode(text) == ids:
                return Window(text, ids)
        raise RuntimeError(f"no stable {num_tokens}-token window in the corpus for this tokenizer")

    def _extend(self) -> None:
        order = list(PARAGRAPHS)
        self._rng.shuffle(order)
        ids = self.encode(" " + "\n\n".join(order) + "\n\n")
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        self._ids.extend(ids)
        self._word_starts.extend(_is_word_start(p) for p in pieces)


def _is_word_start(piece: str) -> bool:
    return len(piece) > 1 and piece[0] in _WORD_MARKS and piece[1].isalpha()

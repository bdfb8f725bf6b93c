"""Incremental detokenization: token ids arrive a few at a time, text leaves as soon as it is final.

Owns: the decode window of one output stream.

    ids:  ... | emitted earlier | emitted last time | new, not yet emitted
              ^ (dropped)       ^ prefix            ^ read

Each push decodes only ids[prefix:] and ids[prefix:read] and emits the difference, so the cost
per token does not grow with the output. Decoding from `prefix` rather than `read` keeps
context-dependent decoders (SentencePiece strips the first token's leading space) right.
While the window decodes to text ending in U+FFFD the last character is still incomplete
(a multi-byte UTF-8 character split across tokens) and is held back.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"
# A held-back tail this many tokens long cannot be one incomplete character (UTF-8 needs at
# most 4 bytes): it is broken bytes, emitted as they are so the window stays small.
_MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    """Text of a token stream, emitted as it becomes final."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_fn = backend.decode if backend is not None else tokenizer.decode
        self._skip = skip_special_tokens
        self._window: list[int] = []   # ids from `prefix` on
        self._read = 0                 # window index of the first id not yet emitted
        self._pieces: list[str] = []

    def push(self, new_ids: list[int]) -> str:
        """Add ids; return the text they complete (may be empty)."""
        self._window.extend(new_ids)
        if len(self._window) == self._read:
            return ""
        prefix_text = self._decode(self._window[:self._read])
        full_text = self._decode(self._window)
        held = len(self._window) - self._read
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT) and held < _MAX_HELD_TOKENS:
            return ""
        return self._emit(full_text[len(prefix_text):])

    def flush(self) -> str:
        """End of stream: whatever is held back, broken characters included."""
        if len(self._window) == self._read:
            return ""
        prefix_text = self._decode(self._window[:self._read])
        return self._emit(self._decode(self._window)[len(prefix_text):])

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _emit(self, delta: str) -> str:
        del self._window[:self._read]   # the new prefix is what was read so far
        self._read = len(self._window)
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip) if ids else ""

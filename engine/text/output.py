"""The text of one output stream: token ids in, text deltas out, cut at the first stop string.

Owns: the text side of one sequence, for the offline API (engine/llm.py) and the server's
pipeline (frontend/generation.py) alike:

    token ids ─▶ IncrementalDetokenizer ─▶ StopChecker ─▶ text delta

Text leaves as soon as it is final: an incomplete UTF-8 character waits in the detokenizer, a
tail that could still grow into a stop string waits in the stop checker. A stop string ends
the stream (the caller then aborts the request); the last push releases whatever is held.
How the text is split into pushes never changes the result (see engine/text/stop.py).
"""
from __future__ import annotations

from duplex.engine.messages import FinishReason
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text.stop import StopChecker


class OutputStream:
    """Token ids of one sequence -> its text; `is_stopped` once a stop string was hit."""

    def __init__(self, detokenizer, stop: list[str] | None = None,
                 include_stop_str: bool = False) -> None:
        self._detokenizer = detokenizer  # None: no tokenizer, so token ids only and no text
        self._stop = StopChecker(stop, include_stop_str) \
            if stop and detokenizer is not None else None
        self._pieces: list[str] = []

    @classmethod
    def for_params(cls, recipe, params: SamplingParams) -> OutputStream:
        """The stream a request with `params` needs (`recipe` None: no text)."""
        detokenizer = None if recipe is None else recipe.new_detokenizer(
            params.skip_special_tokens)
        return cls(detokenizer, params.stop, params.include_stop_str_in_output)

    def push(self, token_ids: list[int], is_last: bool = False) -> str:
        """Add ids; return the text now safe to emit (may be empty). `is_last`: the stream
        ends here, so text held back (a broken character, a partial stop string) goes out."""
        if self._detokenizer is None or self.is_stopped:
            return ""
        text = self._detokenizer.push(token_ids) if token_ids else ""
        if is_last:
            text += self._detokenizer.flush()
        if self._stop is not None:
            text, is_hit = self._stop.push(text)
            if is_last and not is_hit:
                text += self._stop.flush()
        self._pieces.append(text)
        return text

    def finish_reason(self, engine_finish: FinishReason | None) -> FinishReason | None:
        """Why the stream ended: STOP at a stop string, else the engine's reason (None: not
        ended)."""
        return FinishReason.STOP if self.is_stopped else engine_finish

    @property
    def is_stopped(self) -> bool:
        return self._stop is not None and self._stop.stopped

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the stream, if one did."""
        return self._stop.stop_str if self._stop is not None else None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

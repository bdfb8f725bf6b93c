"""Flight: one request's record from `generate()` until its stream ends (its stream, phase,
which worker's deltas count, the tokens the client has seen, deltas held back), and the words
a flight's error starts with.

The table of flights, and every decision about them, belongs to `frontend.dispatcher`
(where a request's way through prefill, hand-off and decode is described); this module holds
no state of its own.
"""
from __future__ import annotations

import asyncio

from duplex.engine.messages import AddRequest, RequestDelta

DEAD_PREFIX = "engine worker died: "
HANDOFF_PREFIX = "KV hand-off failed: "
POLICIES = ("recompute", "fail")


class Flight:
    """One request from `generate()` until its stream ends.

    phase     owner  prefill_id  decode_id     what happens next
    queued    -      -           -             the router sends it to a prompt worker P
    prefill   P      P           D | None      P computes the prompt and the first token
    handoff   D      P           D             P hands the KV to D; D continues
    decode    W      -           W             W (D, a unified P, or a resume target) runs it
    """

    def __init__(self, msg: AddRequest, stream: asyncio.Queue) -> None:
        self.msg = msg
        self.stream = stream
        self.phase = "queued"
        self.owner: str | None = None  # whose deltas count now
        self.prefill_id: str | None = None
        self.decode_id: str | None = None  # None in a split prefill: D died or refused
        self.is_split = False  # P hands it to a decode worker after the first token
        self.output_token_ids: list[int] = []
        self.prompt_fields: dict | None = None  # prompt-side figures of the first delta
        self.prompt_worker: str | None = None  # the worker that sent the first delta
        self.held: list[RequestDelta] = []  # D's deltas that overtook P's first token

    @property
    def workers(self) -> set[str]:
        return {w for w in (self.prefill_id, self.decode_id, self.owner) if w}

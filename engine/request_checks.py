"""The worker's own check of every AddRequest field before the core sees it.

The frontend validates what clients send, but a worker takes frames from any peer on its
channel (another frontend version, a bug, a hostile host), so it checks again: a request
that fails becomes one error delta with `error_kind=INVALID`, never an exception deep in a
step that would kill the worker and every stream on it. SamplingParams checks its own value
rules when it is decoded; this adds what needs the model (the vocabulary) and the bounds on
sizes. The core (`engine.core._check_request`) still checks context and KV-pool length.
"""
from __future__ import annotations

import math

from duplex.engine.messages import AddRequest

MAX_REQ_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024


def check_add_request(msg: AddRequest, core) -> str | None:
    """Why `msg` can never run on `core`, or None when it may."""
    vocab_size = core.vocab_size
    params = msg.params
    checks = (
        (bool(msg.req_id) and len(msg.req_id) <= MAX_REQ_ID_CHARS,
         f"req_id must be 1 to {MAX_REQ_ID_CHARS} characters"),
        (len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
         f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"),
        (all(math.isfinite(t) for t in (msg.arrival_time, msg.deadline)) and msg.deadline >= 0,
         "arrival_time and deadline must be finite, deadline >= 0"),
    )
    for ok, error in checks:
        if not ok:
            return error
    if vocab_size is None:
        return None
    for name, ids in (("prompt_token_ids", msg.prompt_token_ids),
                      ("output_token_ids", msg.output_token_ids),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return f"{name} outside the vocabulary [0, {vocab_size}): {bad[:5]}"
    return None

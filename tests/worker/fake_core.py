"""A fake EngineCore with the real interface: deterministic tokens, no model.

Request r with prompt p produces tokens p[-1]+1, p[-1]+2, ... one per step, finishing with
"length" at max_tokens (16 when None) or "stop" on a stop token id. Knobs come from the
DUPLEX_FAKE_CORE environment variable (JSON), so a worker subprocess can be configured, or
from keyword arguments in-process:
    step_sleep_s   time.sleep per step (releases the GIL, like torch compute)
    load_sleep_s   time.sleep in the constructor (model load)
A prompt containing CRASH_TOKEN makes the next step raise (the WorkerError path).
Requests added and aborted are counted in stats() (num_requests_added / _aborted); like the
real core, an aborted request's final delta (finish "abort", the given error) leads the next
step's.
"""
from __future__ import annotations

import json
import os
import time

from duplex.engine.config import EngineConfig
from duplex.engine.messages import AddRequest, RequestDelta, WorkerStats

CRASH_TOKEN = 666_666
VOCAB_SIZE = 1_000_000
DEFAULT_MAX_MODEL_LEN = 256


class FakeCore:
    vocab_size: int | None = None  # any token id
    cost_model = None  # no step-time model

    def __init__(self, config: EngineConfig, **overrides: float) -> None:
        knobs = {**json.loads(os.environ.get("DUPLEX_FAKE_CORE", "{}")), **overrides}
        self.step_sleep_s: float = knobs.get("step_sleep_s", 0.0)
        time.sleep(knobs.get("load_sleep_s", 0.0))
        self.model_name = "fake"
        self.max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.block_size = config.cache.block_size
        self.num_kv_blocks = config.cache.num_kv_blocks or 64
        self.model_identity = self.kv_layout = ""  # no content-addressed KV
        self.num_threads, self.weights_label = 0, ""
        self.layout = self.runner = self.kv = None  # no KV to hand over
        self.requests: dict[str, tuple[AddRequest, int]] = {}  # req_id -> (msg, num generated)
        self.aborted_req_ids: list[str] = []
        self._pending: list[RequestDelta] = []  # abort finals, sent with the next step
        self.num_added = 0
        self.num_steps = 0
        self.num_generated_tokens = 0

    def add_request(self, msg: AddRequest) -> None:
        prompt = msg.prompt_token_ids
        if msg.req_id in self.requests:
            raise ValueError(f"request id {msg.req_id!r} already exists")
        if not prompt:
            raise ValueError("prompt is empty")
        if any(t < 0 or t >= VOCAB_SIZE for t in prompt):
            raise ValueError(f"token ids must be in [0, {VOCAB_SIZE})")
        if len(prompt) + self._max_tokens(msg) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens exceeds "
                             f"max_model_len {self.max_model_len}")
        self.requests[msg.req_id] = (msg, 0)
        self.num_added += 1

    def abort_requests(self, req_ids: list[str], error: str = "") -> None:
        for req_id in req_ids:
            if self.requests.pop(req_id, None) is not None:
                self.aborted_req_ids.append(req_id)
                self._pending.append(RequestDelta(req_id, [], finish_reason="abort",
                                                  error=error))

    def has_request(self, req_id: str) -> bool:
        return req_id in self.requests

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def step(self) -> list[RequestDelta]:
        pending, self._pending = self._pending, []
        if not self.requests:
            return pending
        time.sleep(self.step_sleep_s)
        self.num_steps += 1
        if any(CRASH_TOKEN in msg.prompt_token_ids for msg, _ in self.requests.values()):
            raise RuntimeError("fake core crash")
        return pending + [self._advance(req_id) for req_id in list(self.requests)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending)

    def stats(self) -> WorkerStats:
        return WorkerStats(num_running=len(self.requests), num_steps=self.num_steps,
                           num_kv_blocks_total=self.num_kv_blocks,
                           num_generated_tokens=self.num_generated_tokens,
                           num_requests_aborted=len(self.aborted_req_ids),
                           num_requests_added=self.num_added)

    def close(self) -> None:
        self.requests.clear()

    def _advance(self, req_id: str) -> RequestDelta:
        msg, num_generated = self.requests[req_id]
        token = (msg.prompt_token_ids[-1] + num_generated + 1) % VOCAB_SIZE
        num_generated += 1
        self.num_generated_tokens += 1
        finish_reason = None
        if token in msg.params.stop_token_ids:
            finish_reason = "stop"
        elif num_generated >= self._max_tokens(msg):
            finish_reason = "length"
        if finish_reason is None:
            self.requests[req_id] = (msg, num_generated)
        else:
            del self.requests[req_id]
        num_prompt_tokens = len(msg.prompt_token_ids) if num_generated == 1 else 0
        return RequestDelta(req_id, [token], finish_reason=finish_reason,
                            num_prompt_tokens=num_prompt_tokens)

    @staticmethod
    def _max_tokens(msg: AddRequest) -> int:
        return msg.params.max_tokens or 16


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What FakeCore generates for `prompt` without stop tokens."""
    return [(prompt[-1] + i) % VOCAB_SIZE for i in range(1, max_tokens + 1)]

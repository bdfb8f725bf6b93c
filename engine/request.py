"""Request: the one mutable object per request inside a worker.

There is no prefill phase and no decode phase: a request has tokens (prompt, then output)
and ``num_computed_tokens`` catching up with them. Prefill, chunked prefill, prefix-cache
hits and preemption-by-recompute are all that one counter moving.

Its fields move only through the transitions below (tests/test_ownership.py checks that
no other module writes any of them, aliases included): `advance` after a step computed
tokens, `restore_prefix` for a prefix-cache or tier hit (the scheduler's, after the KV
manager reserved the blocks), `set_drafts` / `keep_drafts` for
speculation's draft tokens, `rollback` when verification rejected drafts, `preempt` when
the scheduler takes the request's KV away, `start_running` / `finish` for the status.
`check_stop` only says whether a token ends the request (a `Stop`); `finish` is the one
place its finish reason is set, whatever ended it (a stop, a length, an abort, an error).
Its block tables and keys are not here: the KV manager keeps them by req_id.

Overlapped scheduling (engine/core.py) gives a request tokens before their ids are known:
`add_token(PENDING)` appends a placeholder for a token a step in flight is drawing on the
device (the next step already computes it, its id fed from the device), `add_token(id)`
puts an id in the first placeholder (or appends it), `finish` drops what is left.
Placeholders are always the last output tokens, and land in order.

    token index:  0 ........ num_cached ....... num_computed ......... num_tokens
                  |  KV from cache  |  KV computed here  |  scheduled next  |
"""
from __future__ import annotations

import enum
import time
from typing import NamedTuple

import torch

from duplex.engine.messages import FinishReason, TokenLogprob
from duplex.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Stop(NamedTuple):
    """Why a request ends: the finish reason, and the stop token that ended it, if any."""
    reason: FinishReason
    stop_token: int | None = None


class Request:
    def __init__(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), *, arrival_time: float | None = None,
                 cache_salt: str = "", retention: str = "chat", max_tokens: int = 1) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None  # when it was first scheduled (queue time)
        self.cache_salt = cache_salt
        self.retention = retention
        self.max_tokens = max_tokens  # params.max_tokens clipped to the context length
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1 = not yet
        self.cached_tokens_by_tier: dict[str, int] = {}
        # hybrid KV (engine/hybrid_kv.py): positions below replay_end are recomputed for the
        # sliding-window layers only
        self.replay_end = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.logprobs: list[TokenLogprob] = []
        self.num_preemptions = 0
        self._generator: torch.Generator | None = None
        self.draft_generator: torch.Generator | None = None  # a draft model's own stream
        if params.seed is not None:
            self._generator = torch.Generator()
            self.draft_generator = torch.Generator().manual_seed(params.seed)
        self.spec_token_ids: list[int] = []  # draft tokens appended for verification
        self.num_pending = 0  # trailing output tokens whose ids a step in flight still draws
        self.num_draft_proposed = 0
        self.num_draft_accepted = 0

    @property
    def generator(self) -> torch.Generator | None:
        """A seeded request's generator for this step's draws, re-seeded from (seed, output
        position): the token at position i gets the same randomness wherever and whenever it
        is sampled — after a prefill/decode hand-off, a resume on another worker, or a
        preemption. None without a seed (the engine's generator is used)."""
        if self._generator is None:
            return None
        return self._generator.manual_seed(position_seed(self.params.seed,
                                                         self.num_output_tokens))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_decoding(self) -> bool:
        """Every token but the last has KV: the next step computes one token (plus drafts)."""
        return self.num_computed_tokens >= self.num_tokens - 1

    # ------------------------------------------------------------------ transitions
    def advance(self, num_tokens: int) -> None:
        """A step computed the KV of num_tokens more tokens (drafts included)."""
        assert num_tokens >= 0, f"cannot advance by {num_tokens} tokens"
        self.num_computed_tokens += num_tokens

    def restore_prefix(self, num_tokens: int, replay_end: int = 0) -> None:
        """A prefix hit (device, host or disk) left the KV of the first num_tokens tokens;
        positions below replay_end are recomputed for the sliding-window layers only
        (engine.hybrid_kv)."""
        assert 0 <= num_tokens < max(1, self.num_tokens), "a hit leaves one token to compute"
        self.num_computed_tokens = num_tokens
        self.replay_end = replay_end

    def set_drafts(self, token_ids: list[int]) -> None:
        """Draft tokens to verify in the next step, after the request's last token."""
        self.spec_token_ids = list(token_ids)

    def keep_drafts(self, num: int) -> None:
        """Keep only the first num drafts (the step's budget or a grammar cut the rest)."""
        del self.spec_token_ids[max(0, num):]

    def rollback(self) -> int:
        """After verification appended the accepted drafts and one token: the KV of the
        rejected drafts is no longer computed (their slots are overwritten later) and the
        drafts are gone. Returns how many computed tokens were rolled back."""
        num_rejected = max(0, self.num_computed_tokens - (self.num_tokens - 1))
        self.num_computed_tokens -= num_rejected
        self.spec_token_ids = []
        return num_rejected

    def record_drafts(self, num_proposed: int, num_accepted: int) -> None:
        self.num_draft_proposed += num_proposed
        self.num_draft_accepted += num_accepted

    def record_cached(self, by_tier: dict[str, int]) -> None:
        """The prefix hit of the first scheduling is what the request reports (later ones,
        after a preemption, are not)."""
        if self.num_cached_tokens < 0:
            self.num_cached_tokens = sum(by_tier.values())
            self.cached_tokens_by_tier = by_tier

    def start_running(self, now: float) -> None:
        self.status = Status.RUNNING
        if self.scheduled_time is None:
            self.scheduled_time = now

    def preempt(self) -> None:
        """The scheduler freed the request's blocks: it recomputes from token 0 (its prompt
        is then prompt + output so far), without drafts."""
        self.num_computed_tokens = 0
        self.replay_end = 0
        self.spec_token_ids = []
        self.status = Status.PREEMPTED
        self.num_preemptions += 1

    def finish(self, reason: FinishReason, stop_token: int | None = None) -> None:
        """Done, for `reason` (its last token, an abort, an error): placeholders after its
        last token are dropped, the tokens a step in flight computed past the end."""
        self.status = Status.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_token
        if self.num_pending:
            del self.output_token_ids[-self.num_pending:]
            self.num_pending = 0

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output + drafts, without building the whole list."""
        num_prompt, num_tokens = len(self.prompt_token_ids), self.num_tokens
        if start >= num_prompt and end <= num_tokens:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return (self.all_token_ids + self.spec_token_ids)[start:end]

    def add_token(self, token_id: int) -> int:
        """A new output token, returning its index: PENDING appends a placeholder (a step in
        flight draws its id); an id goes into the first placeholder, or is appended."""
        if token_id == PENDING:
            self.num_pending += 1
        elif self.num_pending:
            index = self.num_output_tokens - self.num_pending
            self.output_token_ids[index] = token_id
            self.num_pending -= 1
            return index
        self.output_token_ids.append(token_id)
        return self.num_output_tokens - 1

    def check_stop(self, max_model_len: int, index: int | None = None) -> Stop | None:
        """Whether output token `index` (default: the last) ends the request, and why;
        None if it goes on (`finish` ends it)."""
        index = self.num_output_tokens - 1 if index is None else index
        token_id = self.output_token_ids[index]
        num_out = index + 1
        params = self.params
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return Stop(FinishReason.STOP)
            if token_id in params.stop_token_ids:
                return Stop(FinishReason.STOP, token_id)
        if num_out >= self.max_tokens or self.num_prompt_tokens + num_out >= max_model_len:
            return Stop(FinishReason.LENGTH)
        return None


PENDING = -1  # the id of a placeholder token (engine.core: overlapped scheduling)


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for output position `position` of a request seeded with `seed`
    (splitmix64 of the pair)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1

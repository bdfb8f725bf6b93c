"""SamplingParams: how one request chooses its tokens and when it stops.

A frozen msgspec struct, so the same object is the offline API's argument and travels
over ZeroMQ unchanged. Validation happens at construction; a bad value raises
ValueError naming the field.
"""
from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's own limit)
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar",
                    "structural_tag")
# Constraint.thinking: where the constraint starts relative to a thinking block
THINKING_STARTS = ("", "open", "may_open")


class Constraint(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    """What a request's output must match, as data (engine/grammar.py compiles it).

    kind: json_object (any JSON object), json_schema (spec: the schema's JSON text), regex
    (spec: the pattern), choice (spec: a JSON list of strings), grammar (spec: GBNF/EBNF
    text), structural_tag (spec: an xgrammar structural-tag JSON, e.g. free text with
    triggered tool calls).

    thinking: where the constraint starts. "" (default): at the first output token; "open":
    the output starts inside a thinking block, the constraint holds after its `</think>`;
    "may_open": the output may first write a whole block (`<think>` ... `</think>`). The
    thinking itself is free (engine/grammar.py, `thinking_tag`)."""
    kind: str
    spec: str = ""
    thinking: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in CONSTRAINT_KINDS, "constraint.kind",
               f"must be one of {', '.join(CONSTRAINT_KINDS)}", self.kind)
        _check(self.thinking in THINKING_STARTS, "constraint.thinking",
               f"must be one of {', '.join(map(repr, THINKING_STARTS))}", self.thinking)


# Every generated character is checked against each stop string: bound their number and size.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: chosen token only; N: plus top-N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculate: bool = True  # False: never draft for this request (server speculation on)
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (OpenAI's range)
    constraint: Constraint | None = None  # grammar-constrained decoding (engine/grammar.py)

    def __post_init__(self) -> None:
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]",
               self.frequency_penalty)
        # Far from 1 it divides or multiplies logits into inf and NaN (a fuzzed 1e-128 took
        # a worker down): bounded where it still means something.
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty",
               f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]",
               self.repetition_penalty)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1",
               self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must be <= max_tokens", self.min_tokens)
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"takes at most {MAX_STOP_STRINGS} strings", f"{len(self.stop)} strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
               "stop", f"must be non-empty strings of at most {MAX_STOP_CHARS} characters",
               [s[:40] for s in self.stop])
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative", self.stop_token_ids)
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"must bias at most {MAX_LOGIT_BIAS} tokens", len(self.logit_bias))
        _check(all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
               "logit_bias", "must map token ids >= 0 to biases in [-100, 100]",
               self.logit_bias)
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)", self.seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {rule}, got {value!r}")

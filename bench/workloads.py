"""Benchmark workloads: deterministic (under a seed) lists of conversations to send.

Every workload is a list of `Conversation`s; a single-shot request is a one-turn conversation.
Turn k's request carries the history: every earlier turn's new messages, each followed by the
model's actual reply, then turn k's own new messages. Lengths fixed by a workload are exact
token counts of message contents under the model's tokenizer (see `bench.text`).

| workload      | conversations × turns      | sharing                                        |
| ------------- | -------------------------- | ---------------------------------------------- |
| random        | N × 1                      | none                                           |
| shared-prefix | G·P × 1 (groups shuffled)  | the P prompts of a group share a system prompt |
| multi-turn    | C × T                      | one system prompt; turn k extends turn k−1     |
| agent         | C × T (steps)              | as multi-turn, each step adds a tool result    |
| mooncake      | trace lines × 1            | equal hash-id prefixes → equal token prefixes  |
| structured    | N × 1                      | as random; every other request carries a JSON  |
|               |                            | schema (`response_format`, constrained output) |
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, NamedTuple

from duplex.bench.text import TextSource

WORKLOADS = ("random", "shared-prefix", "multi-turn", "agent", "mooncake", "structured")
AGENT_MARKS = ("header", "tools", "both")
AGENT_HEADER = ("x-duplex-retention", "agent")
MOONCAKE_BLOCK_TOKENS = 512          # tokens behind one hash id in the Mooncake trace
_CONTEXT_MARGIN = 64                 # room left for the chat template around the prompt

Message = dict[str, Any]


class Turn(NamedTuple):
    messages: tuple[Message, ...]    # appended to the history before this turn's request
    max_tokens: int


class Conversation(NamedTuple):
    conversation_id: int
    turns: tuple[Turn, ...]
    arrival_s: float | None = None   # from a trace; None lets the load generator decide
    headers: tuple[tuple[str, str], ...] = ()
    tools: tuple[dict, ...] = ()
    body: tuple[tuple[str, Any], ...] = ()  # extra request fields (e.g. response_format)


class Workload(NamedTuple):
    name: str
    conversations: list[Conversation]
    params: dict[str, Any]

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def default_trace_path() -> str:
    """The shared Mooncake trace, found next to the repository (`../shared/traces/...`)."""
    root = Path(__file__).resolve().parents[1]
    return str(root.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl")


@dataclasses.dataclass(frozen=True)
class WorkloadOptions:
    num_requests: int = 100          # random: number of prompts
    input_len: int = 256             # user message tokens (random prompt, question, turn, task)
    output_len: int = 64
    system_len: int = 512            # shared system prompt (shared-prefix, multi-turn, agent)
    num_groups: int = 4
    prompts_per_group: int = 8
    num_conversations: int = 8
    num_turns: int = 4
    tool_output_len: int = 128
    agent_mark: str = "header"
    trace: str | None = None
    tokens_per_block: int = 16
    time_scale: float = 1.0
    max_requests: int | None = None
    sessions: int = 0                # mooncake: 0 = trace lines in order; N = N sessions
    output_scale: float = 1.0
    max_model_len: int = 8192
    seed: int = 0

    def __post_init__(self):
        for name in ("num_requests", "input_len", "output_len", "system_len", "num_groups",
                     "prompts_per_group", "num_conversations", "num_turns", "tool_output_len",
                     "tokens_per_block", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.agent_mark not in AGENT_MARKS:
            raise ValueError(f"agent_mark must be one of {AGENT_MARKS}, got {self.agent_mark!r}")
        if self.sessions < 0:
            raise ValueError(f"sessions must be >= 0, got {self.sessions}")
        if self.time_scale <= 0 or self.output_scale <= 0:
            raise ValueError("time_scale and output_scale must be positive")


def build_workload(name: str, text: TextSource, options: WorkloadOptions) -> Workload:
    builders = {"random": random_workload, "shared-prefix": shared_prefix_workload,
                "multi-turn": multi_turn_workload, "agent": agent_workload,
                "mooncake": mooncake_workload, "structured": structured_workload}
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return builders[name](text, options)


def random_workload(text: TextSource, options: WorkloadOptions,
                    max_input_len: int | None = None) -> Workload:
    """`num_requests` unrelated prompts of `input_len` tokens each or, with `max_input_len`,
    of lengths drawn uniformly from [input_len, max_input_len] (own seeded stream, so the
    fixed-length workload under a seed stays what it was)."""
    rng = random.Random(f"random:{options.seed}")
    lengths = random_lengths(options, max_input_len)
    conversations = [_single(i, [_user(text.text(n, rng).text)], options.output_len)
                     for i, n in enumerate(lengths)]
    params = _params(options, "num_requests", "input_len", "output_len")
    if max_input_len is not None:
        params["max_input_len"] = max_input_len
    return Workload("random", conversations, params)


STRUCTURED_SCHEMA = {
    "type": "object", "properties": {
        "title": {"type": "string"},
        "points": {"type": "array", "items": {"type": "string"}},
        "rating": {"enum": ["low", "medium", "high"]}},
    "required": ["title", "points", "rating"], "additionalProperties": False}


def structured_workload(text: TextSource, options: WorkloadOptions) -> Workload:
    """The random workload's prompts; requests 0, 2, 4, ... ask for JSON matching
    STRUCTURED_SCHEMA (OpenAI `response_format` json_schema), the others for free text.
    Against `--workload random` with the same seed and lengths: the cost of constraints."""
    plain = random_workload(text, options)
    fmt = {"type": "json_schema", "json_schema": {"name": "summary", "strict": True,
                                                  "schema": STRUCTURED_SCHEMA}}
    conversations = [c._replace(body=(("response_format", fmt),)) if i % 2 == 0 else c
                     for i, c in enumerate(plain.conversations)]
    return Workload("structured", conversations, plain.params)


def random_lengths(options: WorkloadOptions, max_input_len: int | None) -> list[int]:
    if max_input_len is None:
        return [options.input_len] * options.num_requests
    if max_input_len < options.input_len:
        raise ValueError(f"max_input_len {max_input_len} is below input_len {options.input_len}")
    rng = random.Random(f"random-lengths:{options.seed}")
    return [rng.randint(options.input_len, max_input_len) for _ in range(options.num_requests)]


def shared_prefix_workload(text: TextSource, options: WorkloadOptions) -> Workload:
    rng = random.Random(f"shared-prefix:{options.seed}")
    prompts = []
    for _ in range(options.num_groups):
        system = _system(text.text(options.system_len, rng).text)
        prompts += [[system, _user(text.text(options.input_len, rng).text)]
                    for _ in range(options.prompts_per_group)]
    rng.shuffle(prompts)
    conversations = [_single(i, messages, options.output_len) for i, messages in enumerate(prompts)]
    return Workload("shared-prefix", conversations, _params(
        options, "num_groups", "prompts_per_group", "system_len", "input_len", "output_len"))


def multi_turn_workload(text: TextSource, options: WorkloadOptions) -> Workload:
    rng = random.Random(f"multi-turn:{options.seed}")
    system = _system(text.text(options.system_len, rng).text)
    conversations = []
    for i in range(options.num_conversations):
        turns = [Turn((_user(text.text(options.input_len, rng).text),), options.output_len)
                 for _ in range(options.num_turns)]
        turns[0] = Turn((system, *turns[0].messages), options.output_len)
        conversations.append(Conversation(i, tuple(turns)))
    return Workload("multi-turn", conversations, _params(
        options, "num_conversations", "num_turns", "system_len", "input_len", "output_len"))


def agent_workload(text: TextSource, options: WorkloadOptions) -> Workload:
    """Each step after the first appends a tool result; the model's reply follows each step."""
    rng = random.Random(f"agent:{options.seed}")
    system = _system(text.text(options.system_len, rng).text)
    headers = (AGENT_HEADER,) if options.agent_mark in ("header", "both") else ()
    tools = (_TOOL,) if options.agent_mark in ("tools", "both") else ()
    conversations = []
    for i in range(options.num_conversations):
        task = _user(text.text(options.input_len, rng).text)
        turns = [Turn((system, task), options.output_len)]
        turns += [Turn((_tool_result(text.text(options.tool_output_len, rng).text),),
                       options.output_len) for _ in range(options.num_turns - 1)]
        conversations.append(Conversation(i, tuple(turns), headers=headers, tools=tools))
    return Workload("agent", conversations, _params(
        options, "num_conversations", "num_turns", "system_len", "input_len", "tool_output_len",
        "output_len", "agent_mark"))


def mooncake_workload(text: TextSource, options: WorkloadOptions) -> Workload:
    """Replay the Mooncake trace: hash id h becomes one fixed `tokens_per_block`-token block.

    A request's prompt is its blocks concatenated (at most what fits the context), so requests
    whose hash ids share a prefix share a token prefix. Arrival times are the trace timestamps
    divided by `time_scale`; output lengths are scaled by `output_scale` and clipped to fit.

    With `sessions` = N, the replay is instead every request of the trace's first N sessions
    (requests sharing their second hash id; sessions of at least `MIN_SESSION_REQUESTS`),
    in trace order with time rebased to the first one: each session's later turns reuse its
    earlier context, often many minutes later, which is what the RAM and SSD tiers are for.
    """
    path = options.trace or default_trace_path()
    blocks: dict[int, str] = {}
    max_blocks = max((options.max_model_len - _CONTEXT_MARGIN - 1) // options.tokens_per_block, 1)
    conversations = []
    entries = read_trace(path, None if options.sessions else options.max_requests)
    if options.sessions:
        entries = select_sessions(entries, options.sessions)[:options.max_requests]
    start_ms = entries[0]["timestamp"] if entries and options.sessions else 0
    for i, entry in enumerate(entries):
        hash_ids = entry["hash_ids"][:max_blocks]
        prompt = "".join(_block(text, blocks, h, options) for h in hash_ids)
        room = options.max_model_len - _CONTEXT_MARGIN - len(hash_ids) * options.tokens_per_block
        max_tokens = max(1, min(round(entry["output_length"] * options.output_scale), room))
        arrival_s = (entry["timestamp"] - start_ms) / 1e3 / options.time_scale
        conversations.append(Conversation(i, (Turn((_user(prompt),), max_tokens),), arrival_s))
    params = _params(options, "tokens_per_block", "time_scale", "max_requests", "output_scale",
                     "max_model_len", "sessions") | {"trace": path}
    return Workload("mooncake", conversations, params)


MIN_SESSION_REQUESTS = 3


def select_sessions(entries: list[dict[str, Any]], num_sessions: int) -> list[dict[str, Any]]:
    """The requests of the first `num_sessions` sessions with >= MIN_SESSION_REQUESTS
    requests, in trace order. A session is the requests sharing their second hash id (the
    first is the trace-wide system prompt)."""
    sessions: dict[int, list[int]] = {}
    for index, entry in enumerate(entries):
        if len(entry["hash_ids"]) > 1:
            sessions.setdefault(entry["hash_ids"][1], []).append(index)
    chosen = [s for s in sessions.values() if len(s) >= MIN_SESSION_REQUESTS][:num_sessions]
    return [entries[i] for i in sorted(i for s in chosen for i in s)]


def read_trace(path: str, max_requests: int | None = None) -> list[dict[str, Any]]:
    """Trace lines: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if max_requests is not None and len(entries) >= max_requests:
                break
            if line.strip():
                entries.append(_trace_entry(json.loads(line), path, line_no))
    return entries


def _trace_entry(entry: dict, path: str, line_no: int) -> dict:
    missing = {"timestamp", "output_length", "hash_ids"} - entry.keys()
    if missing or not entry["hash_ids"]:
        raise ValueError(f"{path}:{line_no}: trace line lacks {sorted(missing) or 'hash_ids'}")
    return entry


def _block(text: TextSource, blocks: dict[int, str], hash_id: int,
           options: WorkloadOptions) -> str:
    if hash_id not in blocks:
        rng = random.Random(f"mooncake:{options.seed}:{hash_id}")
        blocks[hash_id] = text.text(options.tokens_per_block, rng).text
    return blocks[hash_id]


def _single(conversation_id: int, messages: list[Message], max_tokens: int) -> Conversation:
    return Conversation(conversation_id, (Turn(tuple(messages), max_tokens),))


def _system(content: str) -> Message:
    return {"role": "system", "content": content}


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


def _tool_result(content: str) -> Message:
    # A user message, not role "tool": strict servers reject tool messages that answer no call.
    return {"role": "user", "content": "Tool result:" + content}


def _params(options: WorkloadOptions, *names: str) -> dict[str, Any]:
    return {name: getattr(options, name) for name in ("seed", *names)}


_TOOL = {"type": "function", "function": {
    "name": "search_notes",
    "description": "Search the user's notes and return the matching passages.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}

"""The load generator: sends a workload's conversations to a server and records every request.

Three ways to pace conversations (a single-shot request is a one-turn conversation):

* closed loop (`concurrency` N, the default with N = 1): N clients, each running one whole
  conversation at a time, back to back;
* open loop (`request_rate` R): conversations start at Poisson (burstiness 1) or gamma
  (shape = burstiness) arrival times of mean rate R; `concurrency`, if given, caps in-flight
  requests;
* trace (a workload whose conversations carry arrival times, with neither option given).

Within a conversation turn k+1 starts after turn k ends and carries its actual reply; a turn
that does not succeed ends its conversation. At most `num_requests` requests are sent; at
`max_duration_s` whatever is still running is cancelled (and recorded as cancelled).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from typing import NamedTuple

import aiohttp
import numpy as np
from tqdm import tqdm

from duplex.bench.client import stream_chat
from duplex.bench.record import RequestRecord
from duplex.bench.workloads import Conversation, Message


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/chat/completions"
    model: str = "SmolLM2-135M-Instruct"
    api_key: str | None = None
    concurrency: int | None = None
    request_rate: float | None = None    # requests (conversation starts) per second; inf = all
    burstiness: float = 1.0
    num_requests: int | None = None
    max_duration_s: float = 600.0
    request_timeout_s: float | None = 300.0
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    progress: bool = True

    def __post_init__(self):
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        if not self.max_duration_s > 0:
            raise ValueError(f"max_duration_s must be positive, got {self.max_duration_s}")

    def mode(self, conversations: list[Conversation]) -> str:
        """"rate", "trace" or "concurrency" (see the module docstring)."""
        if self.request_rate is not None:
            return "rate"
        has_times = bool(conversations) and all(c.arrival_s is not None for c in conversations)
        return "trace" if has_times and self.concurrency is None else "concurrency"

    def public(self) -> dict:
        """The config as stored in reports (without the API key)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "api_key"}


class LoadResult(NamedTuple):
    records: list[RequestRecord]
    duration_s: float
    num_planned: int
    timed_out: bool
    mode: str


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Start times (s): first at 0, then gaps ~ Gamma(shape=burstiness, mean=1/rate)."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:num]


async def run_load(conversations: list[Conversation], config: LoadConfig) -> LoadResult:
    num_turns = sum(len(c.turns) for c in conversations)
    num_planned = min(num_turns, config.num_requests or num_turns)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        run = _Run(config, session, num_planned)
        drive = asyncio.create_task(run.drive(conversations))
        done, _ = await asyncio.wait({drive}, timeout=config.max_duration_s)
        end = time.perf_counter()
        timed_out = not done
        if timed_out:
            drive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drive
        else:
            drive.result()
    duration_s = config.max_duration_s if timed_out else end - run.start
    run.progress.close()
    return LoadResult(run.records, duration_s, num_planned, timed_out, config.mode(conversations))


def run_load_sync(conversations: list[Conversation], config: LoadConfig) -> LoadResult:
    """`run_load` on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run_load(conversations, config))


class _Run:
    """State of one load run: the records, the request budget, the in-flight cap."""

    def __init__(self, config: LoadConfig, session: aiohttp.ClientSession, num_planned: int):
        self.config, self.session = config, session
        self.records: list[RequestRecord] = []
        self.num_tickets = num_planned
        self.url = config.url.rstrip("/") + config.endpoint
        self.progress = tqdm(total=num_planned, unit="req", disable=not config.progress,
                             dynamic_ncols=True)
        cap = config.concurrency if config.request_rate is not None else None
        self.limiter = asyncio.Semaphore(cap) if cap else contextlib.nullcontext()
        self.start = time.perf_counter()

    async def drive(self, conversations: list[Conversation]) -> None:
        mode = self.config.mode(conversations)
        if mode == "concurrency":
            queue = list(reversed(conversations))
            async with asyncio.TaskGroup() as group:
                for _ in range(self.config.concurrency or 1):
                    group.create_task(self._client(queue))
            return
        if mode == "rate":
            times = arrival_times(len(conversations), self.config.request_rate,
                                  self.config.burstiness, self.config.seed)
        else:
            times = [c.arrival_s for c in conversations]
        async with asyncio.TaskGroup() as group:
            for at, conversation in sorted(zip(times, conversations), key=lambda p: p[0]):
                if self.num_tickets <= 0:
                    break
                await asyncio.sleep(max(0.0, self.start + at - time.perf_counter()))
                group.create_task(self._conversation(conversation))

    async def _client(self, queue: list[Conversation]) -> None:
        while queue and self.num_tickets > 0:
            await self._conversation(queue.pop())

    async def _conversation(self, conversation: Conversation) -> None:
        history: list[Message] = []
        for turn_index, turn in enumerate(conversation.turns):
            if self.num_tickets <= 0:
                return
            self.num_tickets -= 1
            history.extend(turn.messages)
            record = await self._request(conversation, turn_index, history, turn.max_tokens)
            if not record.is_ok:
                return
            history.append({"role": "assistant", "content": record.text})

    async def _request(self, conversation: Conversation, turn_index: int,
                       messages: list[Message], max_tokens: int) -> RequestRecord:
        async with self.limiter:
            record = RequestRecord(len(self.records), conversation.conversation_id, turn_index)
            self.records.append(record)
            record.send_s = time.perf_counter() - self.start
            await stream_chat(self.session, self.url, self._body(conversation, messages,
                                                                  max_tokens),
                              self._headers(conversation), record, self.config.request_timeout_s)
        self.progress.update(1)
        return record

    def _body(self, conversation: Conversation, messages: list[Message],
              max_tokens: int) -> dict:
        body = {"model": self.config.model, "messages": list(messages), "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": self.config.temperature}
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if conversation.tools:
            body["tools"] = list(conversation.tools)
        body.update(conversation.body)
        return body

    def _headers(self, conversation: Conversation) -> dict[str, str]:
        headers = dict(self.config.headers) | dict(conversation.headers)
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

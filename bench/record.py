"""`RequestRecord`: the timeline of one benchmark request, as the client observed it.

The client (`bench.client`) is the only writer; metrics, reports and comparisons read records
(or their JSON form) and never change them.

    send ─────────── chunk_s[0] ── chunk_s[1] ── ... ── chunk_s[-1] ──── end_s
    t=0 (send_s      = TTFT         ITL = gaps between content chunks     = e2e
     after run start)
"""
from __future__ import annotations

import dataclasses
from typing import Any

OK = "ok"
FAILED = "failed"        # the server answered wrongly or not at all (reason in `error`)
REJECTED = "rejected"    # the server shed load (HTTP 429 / 503)
CANCELLED = "cancelled"  # still running when the run's deadline passed
PENDING = "pending"


@dataclasses.dataclass
class RequestRecord:
    request_id: int
    conversation_id: int
    turn: int
    send_s: float = 0.0                  # seconds after the run started
    chunk_s: list[float] = dataclasses.field(default_factory=list)  # content chunks, after send
    end_s: float | None = None           # stream end (e2e latency), after send
    status: str = PENDING
    http_status: int | None = None
    error: str | None = None             # failure category, e.g. "HTTP 500", "timeout"
    detail: str | None = None            # the raw message behind `error`
    text: str = ""
    prompt_tokens: int | None = None     # from usage, when the server reports it
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    draft_proposed: int | None = None    # speculative decoding, when the server reports it
    draft_accepted: int | None = None

    @property
    def is_ok(self) -> bool:
        return self.status == OK

    def fail(self, error: str, detail: str | None = None, status: str = FAILED) -> None:
        self.status, self.error, self.detail = status, error, detail

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RequestRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

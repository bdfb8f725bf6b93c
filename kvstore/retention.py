"""Retention classes of cached KV: how long a block may be served after it was stored.

Owns the TTL policy. Two classes: ``CHAT`` (7 days) and ``AGENT`` (3 days). Agent traffic
(requests carrying tools or tool results) churns faster, so it is kept for a shorter time.
Every stored block carries an absolute ``expires_at`` computed here; tiers never serve an
entry at or past its expiry.
"""
from __future__ import annotations

import dataclasses

CHAT = "chat"
AGENT = "agent"
CLASSES = (CHAT, AGENT)

DAY_S = 86_400.0
CHAT_TTL_S = 7 * DAY_S
AGENT_TTL_S = 3 * DAY_S


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Time to live per retention class, in seconds."""
    chat_ttl_s: float = CHAT_TTL_S
    agent_ttl_s: float = AGENT_TTL_S

    def __post_init__(self) -> None:
        if self.chat_ttl_s <= 0 or self.agent_ttl_s <= 0:
            raise ValueError(f"TTLs must be positive: {self}")

    def ttl_s(self, cls: str) -> float:
        if cls == CHAT:
            return self.chat_ttl_s
        if cls == AGENT:
            return self.agent_ttl_s
        raise ValueError(f"unknown retention class {cls!r}; expected one of {CLASSES}")

    def expiry(self, cls: str, now: float) -> float:
        """Absolute time at which a block of class `cls` stored at `now` expires."""
        return now + self.ttl_s(cls)


DEFAULT_POLICY = RetentionPolicy()


def classify(explicit: str | None, has_tools: bool) -> str:
    """Retention class of a request: an explicit "chat"/"agent" wins, else agent iff tools."""
    if explicit is not None:
        if explicit not in CLASSES:
            raise ValueError(f"unknown retention class {explicit!r}; expected one of {CLASSES}")
        return explicit
    return AGENT if has_tools else CHAT


def expiry(cls: str, now: float, policy: RetentionPolicy = DEFAULT_POLICY) -> float:
    """Absolute expiry of a block of class `cls` stored at `now` under `policy`."""
    return policy.expiry(cls, now)

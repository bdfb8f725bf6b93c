"""Admission by work: how many sequences and prompt tokens the frontend holds, and who runs next.

`WorkAdmission` owns two things (the request count and draining stay with
`app_state.Admission`):

* The work bound. Every API request reserves its sequences (prompts x n) and prompt tokens
  (each prompt once: its n samples share the prefix) until its last choice ends. A request
  larger than the bound itself can never be admitted: 400 naming the limit. One that would
  overflow what is held now: 429 (Anthropic 529) with Retry-After, since that passes.
* The fair gate. At most `max_running_sequences` sequences are sent to the engine at once
  (about what the workers batch); the rest wait here, and a freed slot goes round-robin:
  tenants (the cache salt: API-key tenant plus the client's `cache_salt`) take turns, then
  the requests of a tenant, then a request's own sequences in order. So a 256-sequence
  request gets one slot per turn like everyone else, and a 1-token chat beside it starts at
  the next free slot instead of after all 256.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from typing import NamedTuple

from duplex.frontend.errors import ApiError, invalid


class Work(NamedTuple):
    num_sequences: int
    num_prompt_tokens: int


class WorkAdmission:
    def __init__(self, max_sequences: int, max_prompt_tokens: int,
                 max_running_sequences: int, metrics=None) -> None:
        self.max_sequences = max_sequences
        self.max_prompt_tokens = max_prompt_tokens
        self.gate = FairGate(max_running_sequences)
        self.metrics = metrics
        self.num_sequences = 0  # reserved now, running or waiting
        self.num_prompt_tokens = 0
        self._flow_ids = itertools.count()

    def reserve(self, work: Work) -> "Reservation":
        """Hold `work` until the reservation is released; raises ApiError (400 when it can
        never fit, overloaded when it does not fit now)."""
        self._check_ever_fits(work)
        if (self.num_sequences + work.num_sequences > self.max_sequences
                or self.num_prompt_tokens + work.num_prompt_tokens > self.max_prompt_tokens):
            self._count_rejected("overloaded")
            raise ApiError("overloaded", f"the server holds {self.num_sequences} of its "
                           f"{self.max_sequences} sequences and {self.num_prompt_tokens} of "
                           f"its {self.max_prompt_tokens} prompt tokens; retry later",
                           code="overloaded")
        self.num_sequences += work.num_sequences
        self.num_prompt_tokens += work.num_prompt_tokens
        return Reservation(self, work, next(self._flow_ids))

    def _check_ever_fits(self, work: Work) -> None:
        if work.num_sequences > self.max_sequences:
            self._count_rejected("too_large")
            raise invalid(f"the request asks for {work.num_sequences} sequences (prompts x n); "
                          f"this server admits at most {self.max_sequences} at once",
                          param="n", code="request_too_large")
        if work.num_prompt_tokens > self.max_prompt_tokens:
            self._count_rejected("too_large")
            raise invalid(f"the request's prompts hold {work.num_prompt_tokens} tokens; this "
                          f"server admits at most {self.max_prompt_tokens} prompt tokens at "
                          "once", param="prompt", code="request_too_large")

    def _count_rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    def _release(self, work: Work) -> None:
        self.num_sequences -= work.num_sequences
        self.num_prompt_tokens -= work.num_prompt_tokens


class Reservation:
    """The work one API request holds; its choices run through the gate as one flow."""

    def __init__(self, owner: WorkAdmission, work: Work, flow_id: int) -> None:
        self._owner, self.work, self.flow_id = owner, work, flow_id
        self._is_released = False

    async def begin_turn(self, tenant: str) -> None:
        """Wait for a fair slot for one of this request's sequences to run in the engine."""
        await self._owner.gate.acquire(tenant, self.flow_id)

    def end_turn(self) -> None:
        """That sequence ended: its slot goes to the next waiter."""
        self._owner.gate.release()

    def release(self) -> None:
        """Idempotent: the reserved work is free again."""
        if not self._is_released:
            self._is_released = True
            self._owner._release(self.work)


class FairGate:
    """Slots for sequences in the engine. A waiter gets a freed slot round-robin: tenants in
    turn, then the flows (API requests) of that tenant in turn, then FIFO within a flow."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a gate needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.num_used = 0
        self._waiting: OrderedDict[str, OrderedDict[int, deque[asyncio.Future]]] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for flows in self._waiting.values() for q in flows.values())

    async def acquire(self, tenant: str, flow_id: int) -> None:
        if self.num_used < self.num_slots and not self._waiting:
            self.num_used += 1
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, OrderedDict()).setdefault(flow_id, deque()).append(
            future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as we were cancelled
                self.release()
            else:
                self._discard(tenant, flow_id, future)
            raise

    def release(self) -> None:
        self.num_used -= 1
        self._grant()

    def _grant(self) -> None:
        while self.num_used < self.num_slots and self._waiting:
            tenant, flows = next(iter(self._waiting.items()))
            flow_id, queue = next(iter(flows.items()))
            future = queue.popleft()
            if not queue:
                del flows[flow_id]
            else:
                flows.move_to_end(flow_id)
            if not flows:
                del self._waiting[tenant]
            else:
                self._waiting.move_to_end(tenant)
            if not future.done():
                future.set_result(None)
                self.num_used += 1

    def _discard(self, tenant: str, flow_id: int, future: asyncio.Future) -> None:
        flows = self._waiting.get(tenant, {})
        queue = flows.get(flow_id)
        if queue is not None and future in queue:
            queue.remove(future)
            if not queue:
                del flows[flow_id]
            if not flows:
                self._waiting.pop(tenant, None)

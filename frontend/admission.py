"""Admission: the one owner of whether an API request may run, and of when its sequences go
to the engine (issue 36: one owner for dispatch; the dispatcher owns the flight table and the
router, this module everything that refuses).

`Admission` decides, once per API request and before any sequence exists, every refusal that
comes from the server's state rather than the request's content, in the API's error shape
(`ApiError`), counted in `duplex_requests_rejected` by reason:

* draining (`drain`): 503, reason "draining";
* no engine worker ready: 503, reason "not_ready";
* the request count: past `max_queued_requests` requests in flight (running or waiting
  anywhere), 429 (Anthropic 529) with Retry-After, reason "overloaded";
* the work bound: every API request reserves its sequences (prompts x n) and prompt tokens
  (each prompt once: its n samples share the prefix) until its last choice ends. A request
  larger than the bound itself can never be admitted: 400 naming the limit (reason
  "too_large"). One that would overflow what is held now: 429 (529) with Retry-After
  (reason "overloaded"), since that passes.

And it owns the fair gate (`FairGate`, its helper): at most `max_running_sequences`
sequences are sent to the engine at once (about what the workers batch); the rest wait here,
and a freed slot goes round-robin: tenants (the cache salt: API-key tenant plus the client's
`cache_salt`) take turns, then the requests of a tenant, then a request's own sequences in
order. So a 256-sequence request gets one slot per turn like everyone else, and a 1-token
chat beside it starts at the next free slot instead of after all 256.

One request's way: the intake asks `Admission.admit()` for a `Ticket` before the body is
read (draining, not ready, the request count); the ticket holds the request slot until it
closes (`with ... as ticket`). Once the prompts are tokenized, `ticket.reserve(work)` holds
the work (400 / 429) and gives the `Reservation` the pipeline is handed: the pipeline takes
and ends turns at the gate with it (`begin_turn`, `end_turn`) and frees the work when the
last choice ends (`release`); it never refuses.

Why this is not the dispatcher's: refusals happen per API request, in the API's error
shape, before a sequence exists; the dispatcher (frontend/dispatcher.py) works on admitted
sequences and never refuses (its router's bucket limits pace prefills, they refuse nothing).
"""
from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from typing import Callable, NamedTuple

from duplex.frontend.errors import ApiError, invalid


class Work(NamedTuple):
    num_sequences: int
    num_prompt_tokens: int


class Limits(NamedTuple):
    max_requests: int  # API requests in flight (max_queued_requests)
    max_sequences: int  # sequences reserved at once (max_queued_sequences)
    max_prompt_tokens: int  # prompt tokens reserved at once (max_queued_prompt_tokens)
    max_running_sequences: int  # sequences in the engine at once: the fair gate's slots


def not_ready() -> ApiError:
    """The refusal while no engine worker is ready (503, retryable)."""
    return ApiError("unavailable", "no engine worker is ready; retry shortly")


class Admission:
    """The one owner of admission (module docstring): the request count and draining, the
    not-ready refusal, the work bound and the fair gate. Read-only outside: `num_active`,
    `draining`, `num_sequences`, `num_prompt_tokens`, `num_running`, `num_waiting`."""

    def __init__(self, limits: Limits, metrics, is_ready: Callable[[], bool] = lambda: True,
                 ) -> None:
        self.limits = limits
        self._metrics = metrics  # frontend.metrics.Metrics: rejected, in_flight
        self._is_ready = is_ready  # a worker is ready
        self._gate = FairGate(limits.max_running_sequences)
        self._num_active = 0  # API requests admitted and not finished
        self._draining = False
        self._num_sequences = 0  # reserved now, running or waiting
        self._num_prompt_tokens = 0
        self._flow_ids = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    def from_options(cls, options, metrics, is_ready: Callable[[], bool]) -> "Admission":
        """From the server's options (`app_state.Options`)."""
        return cls(Limits(options.max_queued_requests, options.max_queued_sequences,
                          options.max_queued_prompt_tokens, options.max_running_sequences),
                   metrics, is_ready)

    # ------------------------------------------------------------ what others may read
    @property
    def num_active(self) -> int:
        return self._num_active

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_sequences(self) -> int:
        return self._num_sequences

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def num_running(self) -> int:
        """Sequences holding a slot of the fair gate (in the engine)."""
        return self._gate.num_used

    @property
    def num_waiting(self) -> int:
        """Sequences waiting at the fair gate for a turn."""
        return self._gate.num_waiting

    # ------------------------------------------------------------ one API request
    def admit(self) -> "Ticket":
        """A ticket for one API request, holding its request slot until closed; raises
        ApiError at once: draining or no worker ready (503), at the request limit (429/529)."""
        if self._draining:
            raise self._refuse("draining", ApiError("unavailable", "the server is shutting down"))
        if not self._is_ready():
            raise self._refuse("not_ready", not_ready())
        if self._num_active >= self.limits.max_requests:
            raise self._refuse("overloaded", ApiError(
                "overloaded", f"the server is at its limit of {self.limits.max_requests} "
                "queued requests; retry later", code="overloaded"))
        self._set_active(+1)
        return Ticket(self)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the admitted ones; True if all finished."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------ for Ticket and Reservation
    def _reserve(self, work: Work) -> "Reservation":
        self._check_ever_fits(work)
        limits = self.limits
        if (self._num_sequences + work.num_sequences > limits.max_sequences
                or self._num_prompt_tokens + work.num_prompt_tokens > limits.max_prompt_tokens):
            raise self._refuse("overloaded", ApiError(
                "overloaded", f"the server holds {self._num_sequences} of its "
                f"{limits.max_sequences} sequences and {self._num_prompt_tokens} of its "
                f"{limits.max_prompt_tokens} prompt tokens; retry later", code="overloaded"))
        self._num_sequences += work.num_sequences
        self._num_prompt_tokens += work.num_prompt_tokens
        return Reservation(self, work, next(self._flow_ids))

    def _check_ever_fits(self, work: Work) -> None:
        limits = self.limits
        if work.num_sequences > limits.max_sequences:
            raise self._refuse("too_large", invalid(
                f"the request asks for {work.num_sequences} sequences (prompts x n); this "
                f"server admits at most {limits.max_sequences} at once", param="n",
                code="request_too_large"))
        if work.num_prompt_tokens > limits.max_prompt_tokens:
            raise self._refuse("too_large", invalid(
                f"the request's prompts hold {work.num_prompt_tokens} tokens; this server "
                f"admits at most {limits.max_prompt_tokens} prompt tokens at once",
                param="prompt", code="request_too_large"))

    def _refuse(self, reason: str, error: ApiError) -> ApiError:
        self._metrics.rejected.labels(reason).inc()
        return error

    def _release(self, work: Work) -> None:
        self._num_sequences -= work.num_sequences
        self._num_prompt_tokens -= work.num_prompt_tokens

    def _set_active(self, step: int) -> None:
        self._num_active += step
        self._metrics.in_flight.set(self._num_active)
        if self._num_active == 0:
            self._idle.set()
        else:
            self._idle.clear()


class Ticket:
    """One admitted API request: holds its request slot until closed (`with admit() as
    ticket`), and from `reserve` on its work; closing frees both (idempotent)."""

    def __init__(self, owner: Admission) -> None:
        self._owner = owner
        self._reservation: Reservation | None = None
        self._is_closed = False

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def reserve(self, work: Work) -> "Reservation":
        """Hold the request's `work` until the reservation is released or the ticket closes;
        raises ApiError (400 when it can never fit, overloaded when it does not fit now)."""
        if self._reservation is not None or self._is_closed:
            raise RuntimeError("a ticket reserves its work once, while open")
        self._reservation = self._owner._reserve(work)
        return self._reservation

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._reservation is not None:
            self._reservation.release()
        self._owner._set_active(-1)


class Reservation:
    """The work one API request holds; its choices run through the gate as one flow. The
    pipeline is handed it and only takes and ends turns and frees it."""

    def __init__(self, owner: Admission, work: Work, flow_id: int) -> None:
        self._owner, self.work, self.flow_id = owner, work, flow_id
        self._is_released = False

    async def begin_turn(self, tenant: str) -> None:
        """Wait for a fair slot for one of this request's sequences to run in the engine."""
        await self._owner._gate.acquire(tenant, self.flow_id)

    def end_turn(self) -> None:
        """That sequence ended: its slot goes to the next waiter."""
        self._owner._gate.release()

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

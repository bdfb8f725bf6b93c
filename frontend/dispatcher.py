"""Dispatcher: the one owner of dispatch decisions in the frontend.

Owns the flight table (every request from `generate()` until its stream ends, its progress
and the aborts still to send), the `Router` (which worker runs what, and when) and the
dispatch loop that sends what the router releases. `EngineClient` owns only the channel and
what it knows of each worker's liveness: it reports events here (a worker joined or died,
its deltas, its heartbeat stats, a failed hand-off, a worker it could not reach) and sends
the messages this module decides on through a `Link`. Only this module calls the router.

A request's way (disaggregated: P = prefill worker, D = decode worker; unified: P is D):

    queued in the router -> sent to P (naming D) -> first token from P -> P hands the KV to D
    -> tokens from D -> final delta

Deltas count only from the worker that owns the request at that point (P until the first
token, then D); tokens D sends before P's first token arrived are held back, so the stream is
always in order. D's deltas carry the prompt-side figures of P's first one (cache hits are P's).
When a worker dies or a hand-off fails, a flight resumes on a live worker from the tokens the
client has seen (policy "recompute") or ends with one error ("fail", or no worker left).

Invariants:
* every `generate()` stream ends after exactly one delta with a finish_reason, whatever
  happens to the workers (finished, aborted, deadline, worker death, failed hand-off, closed);
* a stream the consumer stops reading (break, cancellation, dropped iterator) is aborted on
  every worker involved, so their KV blocks are freed within a step.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol

import msgspec

from duplex.engine.messages import (AbortRequests, AddRequest, FinishReason, HandoffFailed, Ready,
                                    RequestDelta, WorkerStats)
from duplex.frontend.flights import DEAD_PREFIX, POLICIES, Flight, HANDOFF_PREFIX
from duplex.frontend.router import Router

log = logging.getLogger("duplex.frontend.engine_client")

Send = Callable[[str, AddRequest | AbortRequests], Awaitable[None]]


class Link(Protocol):
    """What the dispatcher needs of the channel to the workers (`EngineClient`)."""
    live: Mapping[str, object]  # the live workers' states by id (`.ready.kv_address`)
    ready: bool  # a worker is alive and the channel open

    async def send(self, worker_id: str, msg: AddRequest | AbortRequests) -> None:
        """Put a message to one worker; one that cannot be reached is reported back
        (`Dispatcher.on_unreachable` or `worker_died`)."""


class Dispatcher:
    """Owns the flight table, the router and the dispatch loop (module docstring)."""

    def __init__(self, router: Router | None = None, handoff_failure: str = "recompute") -> None:
        self.router = router or Router()
        self._wakeup = asyncio.Event()
        self._link: Link | None = None
        self._flights: FlightTable | None = None
        self._handoff_failure = handoff_failure
        if handoff_failure not in POLICIES:
            raise ValueError(f"handoff_failure must be one of {POLICIES}, got "
                             f"{handoff_failure!r}")
        self._tasks: list[asyncio.Task] = []

    def attach(self, link: Link) -> None:
        """The channel this dispatcher sends through (once, before `start`)."""
        self._link = link
        self._flights = FlightTable(self.router, link.live, link.send, self._wakeup.set,
                                    self._handoff_failure)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._dispatch_forever()),
                       asyncio.create_task(self._flights.send_aborts_forever())]

    async def close(self) -> None:
        """Every open stream ends with one error; the loops stop."""
        self._flights.fail_all("engine client closed")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._flights.by_id)

    # ------------------------------------------------------------------ requests
    async def generate(self, msg: AddRequest) -> AsyncIterator[RequestDelta]:
        """Submit one request and yield its deltas; the last one has a finish_reason.
        Cancelling the consumer, or `aclose()` on the iterator, aborts the request on the
        workers at once; an iterator merely dropped aborts when it is garbage-collected."""
        flight = self._flights.open(msg)
        is_finished = False
        try:
            if not self._link.ready:
                self._flights.finish(msg.req_id, "engine worker not ready")
            else:
                self.router.enqueue(msg)
                self._wakeup.set()
            while not is_finished:
                delta = await flight.stream.get()
                is_finished = delta.finish_reason is not None
                yield delta
        finally:
            if not is_finished:
                self._flights.abandon(msg.req_id)

    async def abort(self, req_id: str) -> None:
        """End the request now with a finish_reason="abort" delta; the workers running it
        are told to abort it too."""
        flight = self._flights.by_id.get(req_id)
        if flight is not None:
            self._flights.abandon(req_id)
            flight.stream.put_nowait(RequestDelta(req_id, [], finish_reason=FinishReason.ABORT))

    # ------------------------------------------------------------------ events of the link
    def worker_joined(self, ready: Ready) -> None:
        self.router.add_worker(ready)
        self._wakeup.set()

    def worker_died(self, worker_id: str, reason: str) -> None:
        self.router.remove_worker(worker_id)
        self._flights.worker_died(worker_id, DEAD_PREFIX + reason)
        self._wakeup.set()

    def on_outputs(self, worker_id: str, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            self._flights.on_delta(worker_id, delta)

    def on_stats(self, worker_id: str, stats: WorkerStats) -> None:
        self.router.update_stats(worker_id, stats)

    def on_handoff_failed(self, msg: HandoffFailed) -> None:
        self._flights.on_handoff_failed(msg)

    def on_unreachable(self, worker_id: str, msg: AddRequest | AbortRequests) -> None:
        """A message for a worker that is no longer live."""
        self._flights.on_unreachable(worker_id, msg)

    async def _dispatch_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await self._flights.dispatch()


class FlightTable:
    """Every request in flight, by id: its stream and progress (`flights.Flight`), what it
    holds in the router, its recovery, and the aborts still to send to workers."""

    def __init__(self, router: Router, live: Mapping[str, object], send: Send,
                 wake_dispatch: Callable[[], None], handoff_failure: str = "recompute") -> None:
        """`live`: the live workers' states by id (read only: `.ready.kv_address`); `send`
        puts a message to one worker; `wake_dispatch` tells the dispatcher the router may
        release more."""
        self.router = router
        self.handoff_failure = handoff_failure
        self.by_id: dict[str, Flight] = {}
        self._live = live
        self._send = send
        self._wake_dispatch = wake_dispatch
        self._pending_aborts: dict[str, set[str]] = {}  # worker id -> req ids
        self._abort_wakeup = asyncio.Event()

    def open(self, msg: AddRequest) -> Flight:
        if msg.req_id in self.by_id:
            raise ValueError(f"request id {msg.req_id!r} is already in flight")
        flight = self.by_id[msg.req_id] = Flight(msg, asyncio.Queue())
        return flight

    async def dispatch(self) -> None:
        """Send what the router releases."""
        for msg, route in self.router.pop_ready():
            flight = self.by_id.get(msg.req_id)
            if flight is None:  # left while queued
                self.router.prefill_done(route.worker_id, msg.req_id)
                self.router.decode_moved(msg.req_id, route.decode_id, None)
                continue
            flight.phase = "prefill"
            flight.prefill_id = flight.owner = route.worker_id
            flight.decode_id = route.decode_id
            flight.is_split = route.decode_id is not None
            if flight.is_split:
                msg = msgspec.structs.replace(
                    msg, handoff_to=route.decode_id,
                    handoff_address=self._live[route.decode_id].ready.kv_address)
            await self._send(route.worker_id, msg)

    def abandon(self, req_id: str) -> None:
        """The consumer left before the end: forget the stream, abort it on its workers."""
        flight = self.by_id.pop(req_id, None)
        if flight is None:
            return
        if self.router.remove(req_id):
            return
        self._release(flight)
        for worker_id in flight.workers:
            self._pending_aborts.setdefault(worker_id, set()).add(req_id)
        self._abort_wakeup.set()

    def _release(self, flight: Flight) -> None:
        """Give the router back what the flight held."""
        if flight.prefill_id is not None:
            self.router.prefill_done(flight.prefill_id, flight.msg.req_id)
            self._wake_dispatch()
        self.router.decode_moved(flight.msg.req_id, flight.decode_id, None)

    def on_delta(self, worker_id: str, delta: RequestDelta) -> None:
        flight = self.by_id.get(delta.req_id)
        if flight is None:  # aborted or finished already: late deltas are dropped
            return
        if worker_id == flight.owner:
            self._accept(flight, delta)
        elif flight.phase == "prefill" and worker_id == flight.decode_id:
            flight.held.append(delta)  # overtook P's first token: keep the order

    def _accept(self, flight: Flight, delta: RequestDelta) -> None:
        if flight.prompt_fields is None:
            flight.prompt_worker = flight.owner
            flight.prompt_fields = dict(num_prompt_tokens=delta.num_prompt_tokens,
                                        num_cached_tokens=delta.num_cached_tokens,
                                        cached_tokens_by_tier=delta.cached_tokens_by_tier)
        elif flight.owner != flight.prompt_worker:  # the prompt worker's hits are the ones
            delta = msgspec.structs.replace(delta, **flight.prompt_fields)
        if flight.phase == "handoff":
            flight.phase = "decode"  # D runs it: the hand-off landed
            flight.prefill_id = None
        flight.output_token_ids += delta.new_token_ids
        self.route(delta)
        if flight.phase == "prefill" and delta.finish_reason is None and delta.new_token_ids:
            self._prompt_done(flight)

    def _prompt_done(self, flight: Flight) -> None:
        """The first token: the prompt's worker is free of it; who continues?"""
        self.router.prefill_done(flight.prefill_id, flight.msg.req_id)
        self._wake_dispatch()
        if not flight.is_split:  # a unified worker goes on by itself
            flight.phase, flight.prefill_id = "decode", None
            flight.decode_id = flight.owner
        elif flight.decode_id is None:  # its decode worker died or refused meanwhile
            self._resume(flight, "no decode worker took the hand-off")
        else:
            flight.phase, flight.owner = "handoff", flight.decode_id
            held, flight.held = flight.held, []
            for delta in held:
                if flight.msg.req_id in self.by_id:
                    self._accept(flight, delta)

    def route(self, delta: RequestDelta) -> None:
        flight = self.by_id.get(delta.req_id)
        if flight is None:
            return
        if delta.finish_reason is not None:
            del self.by_id[delta.req_id]
            self._release(flight)
        flight.stream.put_nowait(delta)

    def finish(self, req_id: str, error: str) -> None:
        self.route(RequestDelta(req_id, [], finish_reason=FinishReason.ERROR, error=error))

    def fail_all(self, error: str) -> None:
        for req_id in list(self.by_id):
            self.router.remove(req_id)
            self.finish(req_id, error)

    # ------------------------------------------------------------------ recovery
    def _resume(self, flight: Flight, reason: str, exclude: tuple[str, ...] = ()) -> None:
        """Recompute the stream on a live worker from the tokens the client has seen (its
        decode worker if still alive, else the least loaded one), or, when the policy says
        fail or no worker is left, end it with one error."""
        req_id = flight.msg.req_id
        target = None
        if self.handoff_failure == "recompute":
            target = flight.decode_id if flight.decode_id in self._live \
                and flight.decode_id not in exclude else self.router.pick_resume(exclude)
        if target is None:
            self.finish(req_id, reason)
            return
        log.warning("request %s resumes on worker %s after %d tokens: %s", req_id, target,
                    len(flight.output_token_ids), reason)
        for worker_id in flight.workers - {target}:
            if worker_id in self._live:
                self._pending_aborts.setdefault(worker_id, set()).add(req_id)
                self._abort_wakeup.set()
        if flight.prefill_id is not None:
            self.router.prefill_done(flight.prefill_id, req_id)
            self._wake_dispatch()
        self.router.decode_moved(req_id, flight.decode_id, target)
        flight.phase, flight.owner, flight.prefill_id, flight.decode_id = \
            "decode", target, None, target
        flight.held = []
        msg = msgspec.structs.replace(flight.msg, output_token_ids=list(flight.output_token_ids))
        asyncio.ensure_future(self._send(target, msg))

    def on_handoff_failed(self, msg: HandoffFailed) -> None:
        flight = self.by_id.get(msg.req_id)
        if flight is None or flight.decode_id != msg.decode_worker_id:
            return  # ended, or moved on already
        if flight.phase == "prefill":  # the first token is still coming: resume then
            self.router.decode_moved(msg.req_id, flight.decode_id, None)
            flight.decode_id = None
        elif flight.phase == "handoff":
            self._resume(flight, HANDOFF_PREFIX + msg.reason)

    def worker_died(self, dead_id: str, reason: str) -> None:
        """What a worker's death means for each flight: its owner, or the prefill worker of
        a hand-off not yet landed, is gone -> resume; its future decode worker is gone ->
        choose another at the first token. Aborts still queued for it are dropped."""
        self._pending_aborts.pop(dead_id, None)
        for flight in list(self.by_id.values()):
            if dead_id == flight.owner or (flight.phase == "handoff" and
                                           dead_id == flight.prefill_id):
                self._resume(flight, reason, exclude=(dead_id,))
            elif flight.phase == "prefill" and dead_id == flight.decode_id:
                flight.decode_id = None

    async def send_aborts_forever(self) -> None:
        """Batch the aborts of abandoned streams (a burst of disconnects -> one message)."""
        while True:
            await self._abort_wakeup.wait()
            self._abort_wakeup.clear()
            pending, self._pending_aborts = self._pending_aborts, {}
            for worker_id, req_ids in pending.items():
                if worker_id in self._live:
                    await self._send(worker_id, AbortRequests(sorted(req_ids)))

    def on_unreachable(self, worker_id: str, msg: AddRequest | AbortRequests) -> None:
        if isinstance(msg, AddRequest):
            flight = self.by_id.get(msg.req_id)
            if flight is not None and flight.owner == worker_id:
                self._resume(flight, "engine worker unreachable", exclude=(worker_id,))

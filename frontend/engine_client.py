"""EngineClient: the API server's handle on its engine workers (one client per server process).

Owns the frontend end of the worker channel (one ROUTER every worker connects to), the stream
and progress of every request in flight, and what the frontend believes about each worker:
alive or not, its Ready and latest heartbeat. Which worker runs what is the Router's call.

A request's way (disaggregated: P = prefill worker, D = decode worker; unified: P is D):

    queued in the router -> sent to P (naming D) -> first token from P -> P hands the KV to D
    -> tokens from D -> final delta

Deltas count only from the worker that owns the request at that point (P until the first
token, then D); tokens D sends before P's first token arrived are held back, so the stream is
always in order. D's deltas carry the prompt-side figures of P's first one (cache hits are P's).

Invariants:
* every `generate()` stream ends after exactly one delta with a finish_reason, whatever
  happens to the workers (finished, aborted, deadline, worker death, failed hand-off, closed);
* a stream the consumer stops reading (break, cancellation, dropped iterator) is aborted on
  every worker involved, so their KV blocks are freed within a step;
* a worker is dead when it says so (WorkerError), when its process exits (`worker_exited`,
  called by the supervisor), or when it is silent for `heartbeat_timeout_s`. Its requests are
  then recomputed on a live worker from the tokens the client has seen (handoff_failure=
  "recompute", the default) or end with an error ("fail", or when no worker is left).
  `ready` is True while at least one worker is alive.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from engine.messages import (AbortRequests, AddRequest, HandoffFailed, Heartbeat, Outputs, Ready,
                             FinishReason, RequestDelta, WorkerError, WorkerStats)
from engine.curve import CurveKeys
from engine.zmq_io import Channel, frontend_channel
from frontend.router import Router

log = logging.getLogger(__name__)

DEAD_PREFIX = "engine worker died: "
HANDOFF_PREFIX = "KV hand-off failed: "
POLICIES = ("recompute", "fail")

# Called with the Ready of the worker found dead and the reason, e.g. to kill and restart it.
OnWorkerDead = Callable[[Ready, str], None]


class _Flight:
    """One request from `generate()` until its stream ends.

    phase     owner  prefill_id  decode_id     what happens next
    queued    -      -           -             the router sends it to a prompt worker P
    prefill   P      P           D | None      P computes the prompt and the first token
    handoff   D      P           D             P hands the KV to D; D continues
    decode    W      -           W             W (D, a unified P, or a resume target) runs it
    """

    def __init__(self, msg: AddRequest, stream: asyncio.Queue) -> None:
        self.msg = msg
        self.stream = stream
        self.phase = "queued"
        self.owner: str | None = None  # whose deltas count now
        self.prefill_id: str | None = None
        self.decode_id: str | None = None  # None in a split prefill: D died or refused
        self.is_split = False  # P hands it to a decode worker after the first token
        self.output_token_ids: list[int] = []
        self.prompt_fields: dict | None = None  # prompt-side figures of the first delta
        self.prompt_worker: str | None = None  # the worker that sent the first delta
        self.held: list[RequestDelta] = []  # D's deltas that overtook P's first token

    @property
    def workers(self) -> set[str]:
        return {w for w in (self.prefill_id, self.decode_id, self.owner) if w}


class _WorkerState:
    def __init__(self, ready: Ready, peer: bytes) -> None:
        self.ready = ready
        self.peer = peer
        self.last_seen = time.monotonic()
        self.stats: WorkerStats | None = None


class EngineClient:
    def __init__(self, address: str, *, heartbeat_timeout_s: float = 5.0,
                 on_worker_dead: OnWorkerDead | None = None, router: Router | None = None,
                 handoff_failure: str = "recompute", keys: CurveKeys | None = None) -> None:
        if handoff_failure not in POLICIES:
            raise ValueError(f"handoff_failure must be one of {POLICIES}, got "
                             f"{handoff_failure!r}")
        self.address = address
        self.on_worker_dead = on_worker_dead
        self.router = router or Router()
        self.handoff_failure = handoff_failure
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._keys = keys  # CURVE keys of the deployment (engine.curve); None: plain sockets
        self.num_refused_ready = 0  # Ready frames claiming a live worker's id
        self._ctx: zmq.asyncio.Context | None = None
        self._channel: Channel | None = None
        self._tasks: list[asyncio.Task] = []
        self._flights: dict[str, _Flight] = {}
        self._workers: dict[str, _WorkerState] = {}  # alive ones
        self._by_peer: dict[bytes, str] = {}  # routing id -> worker id, alive ones
        self._pending_aborts: dict[str, set[str]] = {}  # worker id -> req ids
        self._abort_wakeup = asyncio.Event()
        self._dispatch_wakeup = asyncio.Event()
        self._ready_event = asyncio.Event()
        self._is_closed = False
        self.ready_info: Ready | None = None  # a live worker's Ready (the latest known if none)

    # ------------------------------------------------------------------ public API
    async def start(self) -> None:
        """Bind the channel (a `tcp://host:*` address resolves to a free port) and listen."""
        self._ctx = zmq.asyncio.Context()
        self._channel = frontend_channel(self._ctx, self.address, self._keys)
        self.address = self._channel.address
        self._tasks = [asyncio.create_task(coro) for coro in
                       (self._receive_forever(), self._send_aborts_forever(),
                        self._watch_heartbeats_forever(), self._dispatch_forever())]

    @property
    def ready(self) -> bool:
        return self._ready_event.is_set()

    async def wait_ready(self, timeout_s: float | None = None) -> Ready:
        await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        return self.ready_info

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    def workers(self) -> dict[str, Ready]:
        """The live workers' Ready, by worker id."""
        return {worker_id: w.ready for worker_id, w in self._workers.items()}

    def worker_stats(self) -> dict[str, WorkerStats]:
        """Latest heartbeat stats of each live worker that sent one."""
        return {worker_id: w.stats for worker_id, w in self._workers.items() if w.stats}

    def stats(self) -> WorkerStats | None:
        """Heartbeat stats summed over the live workers (None before the first)."""
        all_stats = list(self.worker_stats().values())
        if len(all_stats) <= 1:
            return all_stats[0] if all_stats else None
        return WorkerStats.merge(all_stats)  # counts summed, rates re-weighted

    async def generate(self, msg: AddRequest) -> AsyncIterator[RequestDelta]:
        """Submit one request and yield its deltas; the last one has a finish_reason.
        Cancelling the consumer, or `aclose()` on the iterator, aborts the request on the
        workers at once; an iterator merely dropped aborts when it is garbage-collected."""
        if msg.req_id in self._flights:
            raise ValueError(f"request id {msg.req_id!r} is already in flight")
        flight = _Flight(msg, asyncio.Queue())
        self._flights[msg.req_id] = flight
        is_finished = False
        try:
            self._submit(flight)
            while not is_finished:
                delta = await flight.stream.get()
                is_finished = delta.finish_reason is not None
                yield delta
        finally:
            if not is_finished:
                self._abandon(msg.req_id)

    async def abort(self, req_id: str) -> None:
        """End the request now with a finish_reason="abort" delta; the workers running it
        are told to abort it too."""
        flight = self._flights.get(req_id)
        if flight is not None:
            self._abandon(req_id)
            flight.stream.put_nowait(RequestDelta(req_id, [], finish_reason=FinishReason.ABORT))

    def worker_exited(self, pid: int, reason: str) -> None:
        """The supervisor saw process `pid` exit; handle it if it was one of ours."""
        for worker_id, w in list(self._workers.items()):
            if w.ready.pid == pid:
                self._worker_died(worker_id, reason)

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self._fail_all_streams("engine client closed")
        self._ready_event.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            self._channel.close()
            self._ctx.term()

    # ------------------------------------------------------------------ requests
    def _submit(self, flight: _Flight) -> None:
        if not self.ready:
            self._finish(flight.msg.req_id, "engine worker not ready")
            return
        self.router.enqueue(flight.msg)
        self._dispatch_wakeup.set()

    async def _dispatch(self) -> None:
        """Send what the router releases."""
        for msg, route in self.router.pop_ready():
            flight = self._flights.get(msg.req_id)
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
                    handoff_address=self._workers[route.decode_id].ready.kv_address)
            await self._send_to(route.worker_id, msg)

    def _abandon(self, req_id: str) -> None:
        """The consumer left before the end: forget the stream, abort it on its workers."""
        flight = self._flights.pop(req_id, None)
        if flight is None:
            return
        if self.router.remove(req_id):
            return
        self._release(flight)
        for worker_id in flight.workers:
            self._pending_aborts.setdefault(worker_id, set()).add(req_id)
        self._abort_wakeup.set()

    def _release(self, flight: _Flight) -> None:
        """Give the router back what the flight held."""
        if flight.prefill_id is not None:
            self.router.prefill_done(flight.prefill_id, flight.msg.req_id)
            self._dispatch_wakeup.set()
        self.router.decode_moved(flight.msg.req_id, flight.decode_id, None)

    def _on_delta(self, worker_id: str, delta: RequestDelta) -> None:
        flight = self._flights.get(delta.req_id)
        if flight is None:  # aborted or finished already: late deltas are dropped
            return
        if worker_id == flight.owner:
            self._accept(flight, delta)
        elif flight.phase == "prefill" and worker_id == flight.decode_id:
            flight.held.append(delta)  # overtook P's first token: keep the order

    def _accept(self, flight: _Flight, delta: RequestDelta) -> None:
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
        self._route(delta)
        if flight.phase == "prefill" and delta.finish_reason is None and delta.new_token_ids:
            self._prompt_done(flight)

    def _prompt_done(self, flight: _Flight) -> None:
        """The first token: the prompt's worker is free of it; who continues?"""
        self.router.prefill_done(flight.prefill_id, flight.msg.req_id)
        self._dispatch_wakeup.set()
        if not flight.is_split:  # a unified worker goes on by itself
            flight.phase, flight.prefill_id = "decode", None
            flight.decode_id = flight.owner
        elif flight.decode_id is None:  # its decode worker died or refused meanwhile
            self._resume(flight, "no decode worker took the hand-off")
        else:
            flight.phase, flight.owner = "handoff", flight.decode_id
            held, flight.held = flight.held, []
            for delta in held:
                if flight.msg.req_id in self._flights:
                    self._accept(flight, delta)

    def _route(self, delta: RequestDelta) -> None:
        flight = self._flights.get(delta.req_id)
        if flight is None:
            return
        if delta.finish_reason is not None:
            del self._flights[delta.req_id]
            self._release(flight)
        flight.stream.put_nowait(delta)

    def _finish(self, req_id: str, error: str) -> None:
        self._route(RequestDelta(req_id, [], finish_reason=FinishReason.ERROR, error=error))

    def _fail_all_streams(self, error: str) -> None:
        for req_id in list(self._flights):
            self.router.remove(req_id)
            self._finish(req_id, error)

    # ------------------------------------------------------------------ recovery
    def _resume(self, flight: _Flight, reason: str, exclude: tuple[str, ...] = ()) -> None:
        """Recompute the stream on a live worker from the tokens the client has seen (its
        decode worker if still alive, else the least loaded one), or, when the policy says
        fail or no worker is left, end it with one error."""
        req_id = flight.msg.req_id
        target = None
        if self.handoff_failure == "recompute":
            target = flight.decode_id if flight.decode_id in self._workers \
                and flight.decode_id not in exclude else self.router.pick_resume(exclude)
        if target is None:
            self._finish(req_id, reason)
            return
        log.warning("request %s resumes on worker %s after %d tokens: %s", req_id, target,
                    len(flight.output_token_ids), reason)
        for worker_id in flight.workers - {target}:
            if worker_id in self._workers:
                self._pending_aborts.setdefault(worker_id, set()).add(req_id)
                self._abort_wakeup.set()
        if flight.prefill_id is not None:
            self.router.prefill_done(flight.prefill_id, req_id)
            self._dispatch_wakeup.set()
        self.router.decode_moved(req_id, flight.decode_id, target)
        flight.phase, flight.owner, flight.prefill_id, flight.decode_id = \
            "decode", target, None, target
        flight.held = []
        msg = msgspec.structs.replace(flight.msg, output_token_ids=list(flight.output_token_ids))
        asyncio.ensure_future(self._send_to(target, msg))

    def _on_handoff_failed(self, msg: HandoffFailed) -> None:
        flight = self._flights.get(msg.req_id)
        if flight is None or flight.decode_id != msg.decode_worker_id:
            return  # ended, or moved on already
        if flight.phase == "prefill":  # the first token is still coming: resume then
            self.router.decode_moved(msg.req_id, flight.decode_id, None)
            flight.decode_id = None
        elif flight.phase == "handoff":
            self._resume(flight, HANDOFF_PREFIX + msg.reason)

    # ------------------------------------------------------------------ worker liveness
    def _on_ready(self, msg: Ready, peer: bytes) -> None:
        """A worker announces itself. A live worker's id is never taken over: a Ready for it
        from another connection or process is refused and logged (the impostor gets no
        request, the real worker is not touched). The same worker announcing again (each
        reconnect, and every few heartbeats) changes nothing. A restarted process is
        accepted once its predecessor is dead (exit seen, WorkerError, or silence: its
        heartbeats carry its pid, so the new process cannot keep the old one alive)."""
        known = self._workers.get(msg.worker_id)
        if known is not None:
            if known.peer != peer or not _same_worker(known.ready, msg):
                self._refuse_ready(msg, peer, known)
            return
        if self._by_peer.get(peer) not in (None, msg.worker_id):
            self._refuse_ready(msg, peer, self._workers[self._by_peer[peer]])
            return
        log.info("engine worker %s ready (role %s, model %s, pid %d)", msg.worker_id, msg.role,
                 msg.model_name, msg.pid)
        self._workers[msg.worker_id] = _WorkerState(msg, peer)
        self._by_peer[peer] = msg.worker_id
        self.router.add_worker(msg)
        self._update_ready_info()
        self._ready_event.set()
        self._dispatch_wakeup.set()

    def _refuse_ready(self, msg: Ready, peer: bytes, live: _WorkerState) -> None:
        self.num_refused_ready += 1
        if self.num_refused_ready <= 20 or self.num_refused_ready % 1000 == 0:
            log.warning("refused Ready #%d claiming worker %s (pid %d) from connection %r: "
                        "worker %s (pid %d) is live on connection %r", self.num_refused_ready,
                        msg.worker_id, msg.pid, peer, live.ready.worker_id, live.ready.pid,
                        live.peer)

    def _worker_died(self, worker_id: str, reason: str) -> None:
        state = self._workers.pop(worker_id, None)
        if state is None:
            return
        log.error("engine worker %s died: %s", worker_id, reason)
        self._by_peer.pop(state.peer, None)
        self.router.remove_worker(worker_id)
        self._pending_aborts.pop(worker_id, None)
        if not self._workers:
            self._ready_event.clear()
        self._update_ready_info()
        for flight in list(self._flights.values()):
            self._recover(flight, worker_id, DEAD_PREFIX + reason)
        if self.on_worker_dead is not None:
            self.on_worker_dead(state.ready, reason)
        self._dispatch_wakeup.set()

    def _recover(self, flight: _Flight, dead_id: str, reason: str) -> None:
        """What a worker's death means for one flight: its owner, or the prefill worker of a
        hand-off not yet landed, is gone -> resume; its future decode worker is gone ->
        choose another at the first token."""
        if dead_id == flight.owner or (flight.phase == "handoff" and dead_id == flight.prefill_id):
            self._resume(flight, reason, exclude=(dead_id,))
        elif flight.phase == "prefill" and dead_id == flight.decode_id:
            flight.decode_id = None

    def _update_ready_info(self) -> None:
        order = {"unified": 0, "prefill": 1, "decode": 2}
        live = sorted(self._workers.values(), key=lambda w: order.get(w.ready.role, 3))
        if live:
            self.ready_info = live[0].ready

    # ------------------------------------------------------------------ background tasks
    async def _receive_forever(self) -> None:
        while True:
            msg, _, peer = await self._channel.receiver.get()
            if isinstance(msg, Ready):
                self._on_ready(msg, peer)
                continue
            worker_id = self._by_peer.get(peer)
            if worker_id is not None:
                self._dispatch_msg(worker_id, self._workers[worker_id], msg)

    def _dispatch_msg(self, worker_id: str, state: _WorkerState,
                      msg: Outputs | Heartbeat | WorkerError | HandoffFailed) -> None:
        if isinstance(msg, Heartbeat) and msg.pid and msg.pid != state.ready.pid:
            return  # another process on this routing id: it must not keep this one alive
        state.last_seen = time.monotonic()
        match msg:
            case Outputs(deltas=deltas):
                for delta in deltas:
                    self._on_delta(worker_id, delta)
            case Heartbeat(stats=stats):
                state.stats = stats
                self.router.update_stats(worker_id, stats)
            case HandoffFailed():
                self._on_handoff_failed(msg)
            case WorkerError(message=message):
                self._worker_died(worker_id, message)

    async def _dispatch_forever(self) -> None:
        while True:
            await self._dispatch_wakeup.wait()
            self._dispatch_wakeup.clear()
            await self._dispatch()

    async def _send_aborts_forever(self) -> None:
        """Batch the aborts of abandoned streams (a burst of disconnects -> one message)."""
        while True:
            await self._abort_wakeup.wait()
            self._abort_wakeup.clear()
            pending, self._pending_aborts = self._pending_aborts, {}
            for worker_id, req_ids in pending.items():
                if worker_id in self._workers:
                    await self._send_to(worker_id, AbortRequests(sorted(req_ids)))

    async def _watch_heartbeats_forever(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_timeout_s / 4)
            now = time.monotonic()
            for worker_id, state in list(self._workers.items()):
                silent_s = now - state.last_seen
                if silent_s > self._heartbeat_timeout_s:
                    self._worker_died(worker_id, f"no heartbeat for {silent_s:.1f} s")

    async def _send_to(self, worker_id: str, msg: AddRequest | AbortRequests) -> None:
        """Send to a live worker; one that cannot be reached is declared dead."""
        state = self._workers.get(worker_id)
        if state is None:
            self._on_unreachable(worker_id, msg, "engine worker not ready")
            return
        try:
            await self._channel.sender.put(msg, peer=state.peer)
        except zmq.ZMQError as e:
            log.warning("cannot reach engine worker %s: %s", worker_id, e)
            self._worker_died(worker_id, f"unreachable: {e}")

    def _on_unreachable(self, worker_id: str, msg, error: str) -> None:
        if isinstance(msg, AddRequest):
            flight = self._flights.get(msg.req_id)
            if flight is not None and flight.owner == worker_id:
                self._resume(flight, "engine worker unreachable", exclude=(worker_id,))


def _same_worker(old: Ready, new: Ready) -> bool:
    return (old.worker_id, old.pid) == (new.worker_id, new.pid)

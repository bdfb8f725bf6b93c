"""EngineClient: the API server's handle on its engine workers (one client per server process).

Owns the frontend end of the worker channel (one ROUTER every worker connects to), what the
frontend believes about each worker (`_Workers`: alive or not, its Ready and latest
heartbeat) and, through `frontend.flights.Flights`, the stream and progress of every request
in flight (a request's way from the router through prefill, hand-off and decode is described
there). Which worker runs what is the Router's call.

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

import zmq
import zmq.asyncio

from duplex.engine.curve import CurveKeys
from duplex.engine.messages import (AbortRequests, AddRequest, FinishReason, HandoffFailed, Heartbeat,
                             Outputs, Ready, RequestDelta, WorkerError, WorkerStats)
from duplex.engine.zmq_io import Channel, frontend_channel, new_context
from duplex.frontend.flights import DEAD_PREFIX, HANDOFF_PREFIX, POLICIES, Flights
from duplex.frontend.router import Router

log = logging.getLogger(__name__)

__all__ = ["DEAD_PREFIX", "HANDOFF_PREFIX", "POLICIES", "EngineClient"]

# Called with the Ready of the worker found dead and the reason, e.g. to kill and restart it.
OnWorkerDead = Callable[[Ready, str], None]


class _WorkerState:
    def __init__(self, ready: Ready, peer: bytes) -> None:
        self.ready = ready
        self.peer = peer
        self.last_seen = time.monotonic()
        self.stats: WorkerStats | None = None


class _Workers:
    """What the frontend believes about each worker: the live ones by id and by routing id,
    each one's Ready and latest heartbeat, and a live worker's Ready to describe the engine."""

    def __init__(self) -> None:
        self.live: dict[str, _WorkerState] = {}
        self.by_peer: dict[bytes, str] = {}  # routing id -> worker id, alive ones
        self.num_refused_ready = 0  # Ready frames claiming a live worker's id
        self.ready_info: Ready | None = None  # a live worker's Ready (the latest known if none)
        self.ready_event = asyncio.Event()  # set while at least one worker is alive

    def admit(self, msg: Ready, peer: bytes) -> bool:
        """Whether a worker's Ready makes it a new live worker. A live worker's id is never
        taken over: a Ready for it from another connection or process is refused and logged
        (the impostor gets no request, the real worker is not touched). The same worker
        announcing again (each reconnect, and every few heartbeats) changes nothing. A
        restarted process is accepted once its predecessor is dead (exit seen, WorkerError,
        or silence: its heartbeats carry its pid, so the new process cannot keep the old one
        alive)."""
        known = self.live.get(msg.worker_id)
        if known is not None:
            if known.peer != peer or not _same_worker(known.ready, msg):
                self._refuse(msg, peer, known)
            return False
        if self.by_peer.get(peer) not in (None, msg.worker_id):
            self._refuse(msg, peer, self.live[self.by_peer[peer]])
            return False
        log.info("engine worker %s ready (role %s, model %s, pid %d)", msg.worker_id, msg.role,
                 msg.model_name, msg.pid)
        self.live[msg.worker_id] = _WorkerState(msg, peer)
        self.by_peer[peer] = msg.worker_id
        self._update_ready_info()
        self.ready_event.set()
        return True

    def _refuse(self, msg: Ready, peer: bytes, live: _WorkerState) -> None:
        self.num_refused_ready += 1
        if self.num_refused_ready <= 20 or self.num_refused_ready % 1000 == 0:
            log.warning("refused Ready #%d claiming worker %s (pid %d) from connection %r: "
                        "worker %s (pid %d) is live on connection %r", self.num_refused_ready,
                        msg.worker_id, msg.pid, peer, live.ready.worker_id, live.ready.pid,
                        live.peer)

    def remove(self, worker_id: str) -> _WorkerState | None:
        """A worker found dead: no longer live (None if it was not)."""
        state = self.live.pop(worker_id, None)
        if state is None:
            return None
        self.by_peer.pop(state.peer, None)
        if not self.live:
            self.ready_event.clear()
        self._update_ready_info()
        return state

    def _update_ready_info(self) -> None:
        order = {"unified": 0, "prefill": 1, "decode": 2}
        live = sorted(self.live.values(), key=lambda w: order.get(w.ready.role, 3))
        if live:
            self.ready_info = live[0].ready

    def silent(self, timeout_s: float) -> list[tuple[str, float]]:
        """(worker id, seconds silent) of the live workers silent for over timeout_s."""
        now = time.monotonic()
        return [(worker_id, now - state.last_seen) for worker_id, state in self.live.items()
                if now - state.last_seen > timeout_s]


class EngineClient:
    def __init__(self, address: str, *, heartbeat_timeout_s: float = 5.0,
                 on_worker_dead: OnWorkerDead | None = None, router: Router | None = None,
                 handoff_failure: str = "recompute", keys: CurveKeys | None = None) -> None:
        self.address = address
        self.on_worker_dead = on_worker_dead
        self.router = router or Router()
        self.handoff_failure = handoff_failure
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._keys = keys  # CURVE keys of the deployment (engine.curve); None: plain sockets
        self._ctx: zmq.asyncio.Context | None = None
        self._channel: Channel | None = None
        self._tasks: list[asyncio.Task] = []
        self._workers = _Workers()
        self._dispatch_wakeup = asyncio.Event()
        self._flights = Flights(self.router, self._workers.live, self._send_to,
                                self._dispatch_wakeup.set, handoff_failure)
        self._is_closed = False

    # ------------------------------------------------------------------ public API
    async def start(self) -> None:
        """Bind the channel (a `tcp://host:*` address resolves to a free port) and listen."""
        self._ctx = new_context()
        self._channel = frontend_channel(self._ctx, self.address, self._keys)
        self.address = self._channel.address
        self._tasks = [asyncio.create_task(coro) for coro in
                       (self._receive_forever(), self._flights.send_aborts_forever(),
                        self._watch_heartbeats_forever(), self._dispatch_forever())]

    @property
    def ready(self) -> bool:
        return self._workers.ready_event.is_set()

    @property
    def ready_info(self) -> Ready | None:
        """A live worker's Ready (the latest known if none is alive)."""
        return self._workers.ready_info

    @property
    def num_refused_ready(self) -> int:
        """Ready frames refused for claiming a live worker's id."""
        return self._workers.num_refused_ready

    async def wait_ready(self, timeout_s: float | None = None) -> Ready:
        await asyncio.wait_for(self._workers.ready_event.wait(), timeout_s)
        return self.ready_info

    @property
    def num_in_flight(self) -> int:
        return len(self._flights.by_id)

    def workers(self) -> dict[str, Ready]:
        """The live workers' Ready, by worker id."""
        return {worker_id: w.ready for worker_id, w in self._workers.live.items()}

    def worker_stats(self) -> dict[str, WorkerStats]:
        """Latest heartbeat stats of each live worker that sent one."""
        return {worker_id: w.stats for worker_id, w in self._workers.live.items() if w.stats}

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
        flight = self._flights.open(msg)
        is_finished = False
        try:
            if not self.ready:
                self._flights.finish(msg.req_id, "engine worker not ready")
            else:
                self.router.enqueue(msg)
                self._dispatch_wakeup.set()
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

    def worker_exited(self, pid: int, reason: str) -> None:
        """The supervisor saw process `pid` exit; handle it if it was one of ours."""
        for worker_id, w in list(self._workers.live.items()):
            if w.ready.pid == pid:
                self._worker_died(worker_id, reason)

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self._flights.fail_all("engine client closed")
        self._workers.ready_event.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            self._channel.close()
            self._ctx.term()

    # ------------------------------------------------------------------ worker liveness
    def _worker_died(self, worker_id: str, reason: str) -> None:
        state = self._workers.remove(worker_id)
        if state is None:
            return
        log.error("engine worker %s died: %s", worker_id, reason)
        self.router.remove_worker(worker_id)
        self._flights.worker_died(worker_id, DEAD_PREFIX + reason)
        if self.on_worker_dead is not None:
            self.on_worker_dead(state.ready, reason)
        self._dispatch_wakeup.set()

    # ------------------------------------------------------------------ background tasks
    async def _receive_forever(self) -> None:
        while True:
            msg, _, peer = await self._channel.receiver.get()
            if isinstance(msg, Ready):
                if self._workers.admit(msg, peer):
                    self.router.add_worker(msg)
                    self._dispatch_wakeup.set()
                continue
            worker_id = self._workers.by_peer.get(peer)
            if worker_id is not None:
                self._dispatch_msg(worker_id, self._workers.live[worker_id], msg)

    def _dispatch_msg(self, worker_id: str, state: _WorkerState,
                      msg: Outputs | Heartbeat | WorkerError | HandoffFailed) -> None:
        if isinstance(msg, Heartbeat) and msg.pid and msg.pid != state.ready.pid:
            return  # another process on this routing id: it must not keep this one alive
        state.last_seen = time.monotonic()
        match msg:
            case Outputs(deltas=deltas):
                for delta in deltas:
                    self._flights.on_delta(worker_id, delta)
            case Heartbeat(stats=stats):
                state.stats = stats
                self.router.update_stats(worker_id, stats)
            case HandoffFailed():
                self._flights.on_handoff_failed(msg)
            case WorkerError(message=message):
                self._worker_died(worker_id, message)

    async def _dispatch_forever(self) -> None:
        while True:
            await self._dispatch_wakeup.wait()
            self._dispatch_wakeup.clear()
            await self._flights.dispatch()

    async def _watch_heartbeats_forever(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_timeout_s / 4)
            for worker_id, silent_s in self._workers.silent(self._heartbeat_timeout_s):
                self._worker_died(worker_id, f"no heartbeat for {silent_s:.1f} s")

    async def _send_to(self, worker_id: str, msg: AddRequest | AbortRequests) -> None:
        """Send to a live worker; one that cannot be reached is declared dead."""
        state = self._workers.live.get(worker_id)
        if state is None:
            self._flights.on_unreachable(worker_id, msg, "engine worker not ready")
            return
        try:
            await self._channel.sender.put(msg, peer=state.peer)
        except zmq.ZMQError as e:
            log.warning("cannot reach engine worker %s: %s", worker_id, e)
            self._worker_died(worker_id, f"unreachable: {e}")


def _same_worker(old: Ready, new: Ready) -> bool:
    return (old.worker_id, old.pid) == (new.worker_id, new.pid)

"""EngineClient: the API server's handle on its engine workers (one client per server process).

Owns the frontend end of the worker channel (one ROUTER every worker connects to) and what
the frontend believes about each worker (`_Workers`: alive or not, its Ready and latest
heartbeat). Everything decided about requests (the flight table, which worker runs what and
when, recovery) belongs to its `frontend.dispatcher.Dispatcher`: the client reports each
event there and sends what the dispatcher decides (`send`); `generate` and `abort` are the
dispatcher's, passed through.

Invariants:
* every `generate()` stream ends after exactly one delta with a finish_reason (the
  dispatcher's invariant; the client reports every death and closes it);
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
from collections.abc import AsyncIterator, Callable, Mapping

import zmq
import zmq.asyncio

from duplex.engine.curve import CurveKeys
from duplex.engine.messages import (AbortRequests, AddRequest, HandoffFailed, Heartbeat, Outputs,
                                    Ready, RequestDelta, WorkerError, WorkerStats)
from duplex.engine.zmq_io import Channel, frontend_channel, new_context
from duplex.frontend.dispatcher import Dispatcher
from duplex.frontend.flights import DEAD_PREFIX, HANDOFF_PREFIX, POLICIES

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
                 on_worker_dead: OnWorkerDead | None = None,
                 dispatcher: Dispatcher | None = None, keys: CurveKeys | None = None,
                 **dispatch_options) -> None:
        """`dispatcher`: the owner of dispatch decisions (built from `dispatch_options`,
        `router=` and `handoff_failure=`, when not given)."""
        self.address = address
        self.on_worker_dead = on_worker_dead
        self.dispatcher = dispatcher or Dispatcher(**dispatch_options)
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._keys = keys  # CURVE keys of the deployment (engine.curve); None: plain sockets
        self._ctx: zmq.asyncio.Context | None = None
        self._channel: Channel | None = None
        self._tasks: list[asyncio.Task] = []
        self._workers = _Workers()
        self._is_closed = False
        self.dispatcher.attach(self)

    # ------------------------------------------------------------------ public API
    async def start(self) -> None:
        """Bind the channel (a `tcp://host:*` address resolves to a free port) and listen."""
        self._ctx = new_context()
        self._channel = frontend_channel(self._ctx, self.address, self._keys)
        self.address = self._channel.address
        self._tasks = [asyncio.create_task(coro) for coro in
                       (self._receive_forever(), self._watch_heartbeats_forever())]
        self.dispatcher.start()

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
    def live(self) -> Mapping[str, _WorkerState]:
        """The live workers' states by id (read by the dispatcher)."""
        return self._workers.live

    @property
    def num_in_flight(self) -> int:
        return self.dispatcher.num_in_flight

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

    def generate(self, msg: AddRequest) -> AsyncIterator[RequestDelta]:
        """`Dispatcher.generate`: submit one request and yield its deltas."""
        return self.dispatcher.generate(msg)

    async def abort(self, req_id: str) -> None:
        """`Dispatcher.abort`: end the request now."""
        await self.dispatcher.abort(req_id)

    def worker_exited(self, pid: int, reason: str) -> None:
        """The supervisor saw process `pid` exit; handle it if it was one of ours."""
        for worker_id, w in list(self._workers.live.items()):
            if w.ready.pid == pid:
                self._worker_died(worker_id, reason)

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        await self.dispatcher.close()
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
        self.dispatcher.worker_died(worker_id, reason)
        if self.on_worker_dead is not None:
            self.on_worker_dead(state.ready, reason)

    # ------------------------------------------------------------------ background tasks
    async def _receive_forever(self) -> None:
        while True:
            msg, _, peer = await self._channel.receiver.get()
            if isinstance(msg, Ready):
                if self._workers.admit(msg, peer):
                    self.dispatcher.worker_joined(msg)
                continue
            worker_id = self._workers.by_peer.get(peer)
            if worker_id is not None:
                self._report(worker_id, self._workers.live[worker_id], msg)

    def _report(self, worker_id: str, state: _WorkerState,
                      msg: Outputs | Heartbeat | WorkerError | HandoffFailed) -> None:
        if isinstance(msg, Heartbeat) and msg.pid and msg.pid != state.ready.pid:
            return  # another process on this routing id: it must not keep this one alive
        state.last_seen = time.monotonic()
        match msg:
            case Outputs(deltas=deltas):
                self.dispatcher.on_outputs(worker_id, deltas)
            case Heartbeat(stats=stats):
                state.stats = stats
                self.dispatcher.on_stats(worker_id, stats)
            case HandoffFailed():
                self.dispatcher.on_handoff_failed(msg)
            case WorkerError(message=message):
                self._worker_died(worker_id, message)

    async def _watch_heartbeats_forever(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_timeout_s / 4)
            for worker_id, silent_s in self._workers.silent(self._heartbeat_timeout_s):
                self._worker_died(worker_id, f"no heartbeat for {silent_s:.1f} s")

    async def send(self, worker_id: str, msg: AddRequest | AbortRequests) -> None:
        """Send to a live worker; one that is not live is reported to the dispatcher, one
        that cannot be reached is declared dead."""
        state = self._workers.live.get(worker_id)
        if state is None:
            self.dispatcher.on_unreachable(worker_id, msg)
            return
        try:
            await self._channel.sender.put(msg, peer=state.peer)
        except zmq.ZMQError as e:
            log.warning("cannot reach engine worker %s: %s", worker_id, e)
            self._worker_died(worker_id, f"unreachable: {e}")


def _same_worker(old: Ready, new: Ready) -> bool:
    return (old.worker_id, old.pid) == (new.worker_id, new.pid)

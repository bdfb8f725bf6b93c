"""EngineClient: the API server's handle on one engine worker (one client per server process).

Owns the frontend end of the worker channel, the stream of every in-flight request, and what
the frontend believes about the worker: ready or not, its latest heartbeat stats.

Invariants:
* every `generate()` stream ends after exactly one delta with a finish_reason, whatever
  happens to the worker (finished, aborted, deadline, worker death, client closed);
* a stream the consumer stops reading (break, cancellation, dropped iterator) is aborted on
  the worker, so its KV blocks are freed within a step;
* a worker is dead when it says so (WorkerError), when its process exits (`worker_exited`,
  called by the supervisor), or when it is silent for `heartbeat_timeout_s`; then `ready`
  stays False until a worker sends Ready again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from engine.messages import (AbortRequests, AddRequest, Heartbeat, Outputs, Ready, RequestDelta,
                             WorkerError, WorkerStats)
from engine.zmq_io import Channel, frontend_channel

log = logging.getLogger(__name__)

DEAD_PREFIX = "engine worker died: "

# Called with the Ready of the worker found dead and the reason, e.g. to kill and restart it.
OnWorkerDead = Callable[[Ready, str], None]


class EngineClient:
    def __init__(self, address: str, *, heartbeat_timeout_s: float = 5.0,
                 on_worker_dead: OnWorkerDead | None = None) -> None:
        self.address = address
        self.on_worker_dead = on_worker_dead
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._ctx: zmq.asyncio.Context | None = None
        self._channel: Channel | None = None
        self._tasks: list[asyncio.Task] = []
        self._streams: dict[str, asyncio.Queue[RequestDelta]] = {}
        self._pending_aborts: set[str] = set()
        self._abort_wakeup = asyncio.Event()
        self._ready_event = asyncio.Event()
        self._worker_peer = b""
        self._last_seen = 0.0  # time.monotonic() of the worker's latest message
        self._stats: WorkerStats | None = None
        self._is_closed = False
        self.ready_info: Ready | None = None  # the latest Ready; `ready` says if it still holds

    # ------------------------------------------------------------------ public API
    async def start(self) -> None:
        """Bind the channel (a `tcp://host:*` address resolves to a free port) and listen."""
        self._ctx = zmq.asyncio.Context()
        self._channel = frontend_channel(self._ctx, self.address)
        self.address = self._channel.address
        self._tasks = [asyncio.create_task(coro) for coro in
                       (self._receive_forever(), self._send_aborts_forever(),
                        self._watch_heartbeats_forever())]

    @property
    def ready(self) -> bool:
        return self._ready_event.is_set()

    async def wait_ready(self, timeout_s: float | None = None) -> Ready:
        await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        return self.ready_info

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> WorkerStats | None:
        """Stats of the latest heartbeat (None before the first)."""
        return self._stats

    async def generate(self, msg: AddRequest) -> AsyncIterator[RequestDelta]:
        """Submit one request and yield its deltas; the last one has a finish_reason.
        Cancelling the consumer, or `aclose()` on the iterator, aborts the request on the
        worker at once; an iterator merely dropped aborts when it is garbage-collected."""
        if msg.req_id in self._streams:
            raise ValueError(f"request id {msg.req_id!r} is already in flight")
        stream: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._streams[msg.req_id] = stream
        is_finished = False
        try:
            await self._submit(msg)
            while not is_finished:
                delta = await stream.get()
                is_finished = delta.finish_reason is not None
                yield delta
        finally:
            if not is_finished:
                self._abandon(msg.req_id)

    async def abort(self, req_id: str) -> None:
        """Abort on the worker; the request's stream then ends with a finish_reason="abort"
        delta sent back by the worker."""
        if req_id in self._streams and self.ready:
            await self._send(AbortRequests([req_id]))

    def worker_exited(self, pid: int, reason: str) -> None:
        """The supervisor saw process `pid` exit; fail everything if it was our worker."""
        if self.ready and self.ready_info.pid == pid:
            self._worker_died(reason)

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
    async def _submit(self, msg: AddRequest) -> None:
        if not self.ready:
            self._finish(msg.req_id, "engine worker not ready")
        elif not await self._send(msg):
            self._finish(msg.req_id, "engine worker unreachable")

    def _abandon(self, req_id: str) -> None:
        """The consumer left before the end: forget the stream, abort it on the worker."""
        if self._streams.pop(req_id, None) is not None and self.ready:
            self._pending_aborts.add(req_id)
            self._abort_wakeup.set()

    def _route(self, delta: RequestDelta) -> None:
        stream = self._streams.get(delta.req_id)
        if stream is None:  # aborted or finished already: late deltas are dropped
            return
        if delta.finish_reason is not None:
            del self._streams[delta.req_id]
        stream.put_nowait(delta)

    def _finish(self, req_id: str, error: str) -> None:
        self._route(RequestDelta(req_id, [], finish_reason="error", error=error))

    def _fail_all_streams(self, error: str) -> None:
        for req_id in list(self._streams):
            self._finish(req_id, error)

    # ------------------------------------------------------------------ worker liveness
    def _on_ready(self, msg: Ready, peer: bytes) -> None:
        if self.ready and _same_worker(self.ready_info, msg):  # it reconnected: keep going
            self._worker_peer, self._last_seen = peer, time.monotonic()
            return
        if self.ready:  # a new Ready without a death notice: the old worker is gone
            self._worker_died(f"worker {msg.worker_id} restarted")
        log.info("engine worker %s ready (role %s, model %s, pid %d)", msg.worker_id, msg.role,
                 msg.model_name, msg.pid)
        self.ready_info, self._worker_peer = msg, peer
        self._last_seen = time.monotonic()
        self._ready_event.set()

    def _worker_died(self, reason: str) -> None:
        log.error("engine worker %s died: %s", self._worker_peer.decode(errors="replace"), reason)
        self._ready_event.clear()
        self._pending_aborts.clear()
        self._fail_all_streams(DEAD_PREFIX + reason)
        if self.on_worker_dead is not None and self.ready_info is not None:
            self.on_worker_dead(self.ready_info, reason)

    # ------------------------------------------------------------------ background tasks
    async def _receive_forever(self) -> None:
        while True:
            msg, _, peer = await self._channel.receiver.get()
            if isinstance(msg, Ready):
                self._on_ready(msg, peer)
            elif self.ready and peer == self._worker_peer:
                self._dispatch(msg)

    def _dispatch(self, msg: Outputs | Heartbeat | WorkerError) -> None:
        self._last_seen = time.monotonic()
        match msg:
            case Outputs(deltas=deltas):
                for delta in deltas:
                    self._route(delta)
            case Heartbeat(stats=stats):
                self._stats = stats
            case WorkerError(message=message):
                self._worker_died(message)

    async def _send_aborts_forever(self) -> None:
        """Batch the aborts of abandoned streams (a burst of disconnects -> one message)."""
        while True:
            await self._abort_wakeup.wait()
            self._abort_wakeup.clear()
            req_ids, self._pending_aborts = sorted(self._pending_aborts), set()
            if req_ids and self.ready:
                await self._send(AbortRequests(req_ids))

    async def _watch_heartbeats_forever(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_timeout_s / 4)
            silent_s = time.monotonic() - self._last_seen
            if self.ready and silent_s > self._heartbeat_timeout_s:
                self._worker_died(f"no heartbeat for {silent_s:.1f} s")

    async def _send(self, msg: AddRequest | AbortRequests) -> bool:
        try:
            await self._channel.sender.put(msg, peer=self._worker_peer)
            return True
        except zmq.ZMQError as e:
            log.warning("cannot reach engine worker: %s", e)
            return False


def _same_worker(old: Ready, new: Ready) -> bool:
    return (old.worker_id, old.pid) == (new.worker_id, new.pid)

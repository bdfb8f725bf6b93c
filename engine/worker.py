"""The engine worker: one asyncio loop serving one EngineCore over one ZMQ channel.

Owns the core (nothing else calls it), the deadlines of the requests it has admitted
(engine/deadlines.py) and the inbox of messages that arrived while a step was running. Which
requests run is the core's to say (`has_request`); the core also reports every request's end,
an abort included, so each stream gets exactly one final delta.

Roles: a unified worker runs requests to their end. A prefill worker runs a request that names
a decode worker (`handoff_to`) up to its first token and hands its KV over
(`engine.kv_transfer.KVSender`); a decode worker binds a KV door and continues what prefill
workers hand it (`KVIntake`). Any worker runs a request without `handoff_to` to its end, so a
stream can always be recomputed wherever a worker is alive.

Threading invariant: the core is built and stepped in ONE executor thread, and every other
core call (add, abort, stats) runs on the loop thread while no step is in flight, so the core
is never entered by two threads at once. While a step computes (torch releases the GIL) the
loop keeps receiving, heartbeating and queueing control messages.

Lifecycle: connect -> build the core -> warm-up step -> serve, sending Ready on each
(re)connection -> exit 0 after Shutdown, or send WorkerError and exit 1 on any unexpected
exception.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.curve import CurveKeys
from engine.deadlines import DEADLINE_ERROR, Deadlines
from engine.kv_transfer import LEASE_S, KVIntake, KVSender, prefill_part
from engine.messages import (INVALID, AbortRequests, AddRequest, FinishReason, Heartbeat, Outputs,
                             Ready, RequestDelta, Shutdown, WorkerError, WorkerStats)
from engine.request_checks import check_add_request
from engine.sampling_params import SamplingParams
from engine.stats import HandoffStats, IntakeStats
from engine.zmq_io import Channel, worker_channel
from kvstore.shared import store_identity

if TYPE_CHECKING:  # torch stays unloaded in workers on fake cores
    from engine.model_runner import ModelRunner
    from engine.kv_manager import KVCacheManager

log = logging.getLogger(__name__)

ROLES = ("unified", "prefill", "decode")
__all__ = ["DEADLINE_ERROR", "SHUTDOWN_ERROR", "Worker", "check_role", "role_config"]
SHUTDOWN_ERROR = "worker shutting down"
DEFAULT_KV_BIND = "tcp://127.0.0.1:*"
_HANDOFF_TICK_S = 0.25  # how often leases are checked while hand-offs are in flight
_STATS_REFRESH_S = 0.1  # most age of the stats snapshot heartbeats carry while stepping
_REANNOUNCE_EVERY = 4  # heartbeats between repeated Ready messages


def role_config(config: EngineConfig, role: str) -> EngineConfig:
    """A decode worker receives KV blocks into its host tier: it gets one (as large as the
    device pool) when none is configured."""
    if role == "decode" and config.cache.enable_prefix_caching and config.cache.kv_host_bytes <= 0:
        return config.replace(kv_host_bytes=config.cache.kv_cache_bytes)
    return config


def check_role(core: Core, role: str) -> None:
    """Refuse a prefill or decode role for a core whose KV cannot be handed over (hybrid
    sliding-window KV) instead of quietly serving as a unified worker."""
    if role != "unified" and core.runner is not None and core.layout is not None:
        raise ValueError(f"a {role} worker cannot hand over hybrid (sliding-window) KV: serve "
                         "this model with --no-hybrid-kv, or with one unified worker")


class _HandedOver(NamedTuple):
    """Inbox item: a request a prefill worker handed to this decode worker."""
    msg: AddRequest


class Core(Protocol):
    """What the worker needs of an engine: `engine.core.EngineCore`, the expert-parallel
    group's `engine.ep_group.LeaderCore`, a fake in tests. A core without a `runner` and
    `kv` of its own (None: the EP group) gets no KV hand-off sides, so it serves every
    request itself."""
    model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    model_identity: str  # what its KV block keys are made of (kvstore.keys.namespace)
    kv_layout: str
    num_threads: int
    weights_label: str
    layout: object | None  # a hybrid (sliding-window) KV layout: its KV cannot be handed over
    runner: ModelRunner | None  # whose KV cache the hand-off sides read and write
    kv: KVCacheManager | None  # whose leases (`kv.handoff`) they hold blocks with

    def add_request(self, msg: AddRequest) -> None: ...
    def abort_requests(self, req_ids: list[str], error: str = "") -> None: ...
    def has_request(self, req_id: str) -> bool: ...
    def request_ids(self) -> list[str]: ...
    def step(self) -> list[RequestDelta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> WorkerStats: ...
    def close(self) -> None: ...


CoreFactory = Callable[[EngineConfig], Core]


class Worker:
    def __init__(self, config: EngineConfig, core_factory: CoreFactory, *, address: str,
                 worker_id: str, role: str = "unified", heartbeat_s: float = 0.5,
                 step_in_thread: bool = True, kv_bind: str = DEFAULT_KV_BIND,
                 lease_s: float = LEASE_S, keys: CurveKeys | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.config = config
        self.worker_id = worker_id
        self.role = role
        self._core_factory = core_factory
        self._address = address
        self._heartbeat_s = heartbeat_s
        self._stats_refresh_s = min(heartbeat_s / 2, _STATS_REFRESH_S)
        self._stats_time = 0.0
        self._step_in_thread = step_in_thread  # False only to measure what the thread costs
        self._kv_bind = kv_bind
        self._lease_s = lease_s
        self._keys = keys  # CURVE on the worker channel and the KV door (engine.curve)
        self._ctx: zmq.asyncio.Context | None = None
        self._sender: KVSender | None = None  # prefill role, real core
        self._intake: KVIntake | None = None  # decode role, real core
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="core")
        self._core: Core | None = None
        self._channel: Channel | None = None
        self._inbox: deque[msgspec.Struct] = deque()
        self._wakeup = asyncio.Event()
        self._outbox: list[RequestDelta] = []  # deltas made between steps, sent with the next
        self._deadlines = Deadlines()
        self._is_stepping = False
        self._stats = WorkerStats()
        self._drain_until: float | None = None  # set by Shutdown: time.monotonic() limit

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> int:
        """Serve until Shutdown (returns 0) or a fatal error (sends WorkerError, returns 1)."""
        ctx = self._ctx = zmq.asyncio.Context()
        self._channel = worker_channel(ctx, self._address, self.worker_id, self._keys)
        try:
            await self._start_core()
            await self._serve_with_background_tasks()
            return 0
        except Exception as e:  # noqa: BLE001 - every failure must become a WorkerError
            log.exception("worker %s failed", self.worker_id)
            await self._send_error(_describe(e))
            return 1
        finally:
            await self._close_core()
            self._executor.shutdown(wait=False, cancel_futures=True)
            for side in (self._sender, self._intake):
                if side is not None:
                    side.close()
            self._channel.close(linger_ms=1000)  # let the last Outputs / WorkerError leave
            ctx.term()

    @property
    def core(self) -> Core | None:
        """The engine, read-only for callers (e.g. to save its cost model after `run`)."""
        return self._core

    def request_shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Same as receiving Shutdown (for signal handlers)."""
        self._inbox.append(Shutdown(drain_timeout_s=drain_timeout_s))
        self._wakeup.set()

    async def _start_core(self) -> None:
        self._core = await self._in_core_thread(self._core_factory, self.config)
        await self._in_core_thread(self._warm_up)
        self._stats = self._core.stats()
        self._attach_role()

    def _attach_role(self) -> None:
        """Hand-off sides need a core's own runner."""
        core = self._core
        check_role(core, self.role)
        if core.runner is None:
            return
        if self.role == "prefill":
            self._sender = KVSender(core.kv.handoff, core.runner.kv, core.max_model_len,
                                    self._ctx, self.worker_id, wakeup=self._wakeup.set,
                                    lease_s=self._lease_s, keys=self._keys)
        elif self.role == "decode":
            self._intake = KVIntake(core.kv.handoff, core.runner.kv, self._ctx, self._kv_bind,
                                    deliver=self._deliver_handed_over,
                                    is_live=core.has_request, keys=self._keys)

    async def _close_core(self) -> None:
        """Let the core flush and release what it holds (KV writes, an EP group), in its own
        thread; skipped while a step is still in flight there."""
        if self._core is None or self._is_stepping:
            return
        try:
            await asyncio.wait_for(self._in_core_thread(self._core.close), 10.0)
        except Exception:  # noqa: BLE001 - exiting anyway
            log.exception("worker %s: closing the core failed", self.worker_id)

    def _warm_up(self) -> None:
        """One tiny request through the whole path, so the first real step is not the slowest."""
        req = AddRequest(f"warmup-{self.worker_id}", [0],
                         SamplingParams(temperature=0.0, max_tokens=1))
        self._core.add_request(req)
        for _ in range(16):
            if not self._core.has_unfinished_requests():
                return
            self._core.step()
        self._core.abort_requests([req.req_id])
        self._core.step()  # takes the abort's final delta: no stream waits for it

    async def _serve_with_background_tasks(self) -> None:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._announce_forever()),
                     group.create_task(self._receive_forever()),
                     group.create_task(self._heartbeat_forever())]
            if self._intake is not None:
                tasks.append(group.create_task(self._intake.serve_forever()))
            if self._sender is not None:
                tasks.append(group.create_task(self._tick_forever()))
            await self._serve()
            for task in tasks:
                task.cancel()

    # ------------------------------------------------------------------ the loop
    async def _serve(self) -> None:
        while not self._is_done():
            await self._wait_for_work()
            self._apply_inbox()  # add / abort / shutdown, only between steps
            self._expire_deadlines()
            self._end_drain_if_due()
            await self._hand_off()  # offers of new requests go out before their first step
            if self._core.has_unfinished_requests():
                self._outbox += await self._step()
            await self._send_outbox()
            await self._hand_off()  # blocks the step completed, KvDone after first tokens

    def _is_done(self) -> bool:
        return (self._drain_until is not None and not self._inbox
                and not self._core.has_unfinished_requests())

    async def _wait_for_work(self) -> None:
        """Block while idle: no spin, the next message wakes us."""
        self._wakeup.clear()
        if not self._inbox and not self._core.has_unfinished_requests():
            await self._wakeup.wait()

    def _apply_inbox(self) -> None:
        while self._inbox:
            match self._inbox.popleft():
                case AddRequest() as req:
                    self._add(req)
                case _HandedOver(msg=req):
                    self._continue(req)
                case AbortRequests(req_ids=req_ids):
                    self._abort(req_ids, error="")
                    self._forget_handoffs(req_ids)
                case Shutdown(drain_timeout_s=drain_s):
                    self._begin_shutdown(drain_s)

    async def _step(self) -> list[RequestDelta]:
        self._is_stepping = True
        try:
            if self._step_in_thread:
                deltas = await self._in_core_thread(self._core.step)
            else:
                deltas = self._core.step()
                await asyncio.sleep(0)  # let receive and heartbeat run between steps
        finally:
            self._is_stepping = False
        if time.monotonic() - self._stats_time >= self._stats_refresh_s:
            self._refresh_stats()  # fresh enough for heartbeats sent during the next steps
        if self._sender is not None:
            deltas = self._sender.after_step(deltas)  # pins handed-off blocks at once
        return deltas

    async def _send_outbox(self) -> None:
        if self._outbox:
            deltas, self._outbox = self._outbox, []
            await self._send(Outputs(self.worker_id, deltas))

    # ------------------------------------------------------------------ requests
    def _add(self, req: AddRequest) -> bool:
        """Admit req; False (after an error delta) if it cannot run. A request already
        running here is a resume that raced with its own hand-off: it keeps running."""
        if self._core.has_request(req.req_id) and (req.output_token_ids or self._intake):
            log.info("worker %s: %s already runs here", self.worker_id, req.req_id)
            return True
        is_handoff = self._sender is not None and bool(req.handoff_to)
        if self._sender is not None:
            self._sender.cancel([req.req_id])  # added again: it supersedes its old hand-off
        error, kind = self._admission_error(req), ""
        if error is None:
            error = check_add_request(req, self._core)
            kind = INVALID if error is not None else ""
        if error is None:
            try:
                self._core.add_request(prefill_part(req) if is_handoff else req)
            except ValueError as e:  # the core's own checks: the request can never run
                error, kind = str(e) or "invalid request", INVALID
        if error is not None:
            self._outbox.append(_final_delta(req.req_id, FinishReason.ERROR, error, kind))
            return False
        self._deadlines.add(req.req_id, req.deadline)
        if is_handoff:
            self._sender.start(req)
        return True

    def _continue(self, req: AddRequest) -> None:
        """A handed-over request: run it, then acknowledge (the prefill side frees)."""
        if self._add(req):
            self._intake.accepted(req.req_id)
        else:
            self._intake.refused(req.req_id, "could not be admitted")

    def _deliver_handed_over(self, req: AddRequest) -> None:
        self._inbox.append(_HandedOver(req))
        self._wakeup.set()

    def _forget_handoffs(self, req_ids: list[str]) -> None:
        if self._sender is not None:
            self._sender.cancel(req_ids)
        if self._intake is not None:
            self._intake.forget(req_ids)

    async def _hand_off(self) -> None:
        if self._sender is not None:
            for failure in await self._sender.pump():
                await self._send(failure)
        if self._intake is not None:
            await self._intake.flush()

    def _admission_error(self, req: AddRequest) -> str | None:
        if self._drain_until is not None:
            return SHUTDOWN_ERROR
        if self._deadlines.is_past(req.deadline):
            return DEADLINE_ERROR
        return None

    def _abort(self, req_ids: list[str], *, error: str) -> None:
        """Abort those of `req_ids` the core still runs; the core reports each one's end
        (finish "abort" with `error`) among the next step's deltas."""
        live = [req_id for req_id in dict.fromkeys(req_ids) if self._core.has_request(req_id)]
        if not live:
            return
        self._core.abort_requests(live, error=error)
        if self._sender is not None:
            self._sender.cancel(live)

    def _expire_deadlines(self) -> None:
        self._abort(self._deadlines.pop_expired(), error=DEADLINE_ERROR)

    def _begin_shutdown(self, drain_timeout_s: float) -> None:
        if self._drain_until is None:
            log.info("worker %s: shutdown, draining for up to %.1f s", self.worker_id,
                     drain_timeout_s)
            self._drain_until = time.monotonic() + max(drain_timeout_s, 0.0)

    def _end_drain_if_due(self) -> None:
        if self._drain_until is not None and time.monotonic() >= self._drain_until:
            self._abort(self._core.request_ids(), error=SHUTDOWN_ERROR)

    # ------------------------------------------------------------------ background tasks
    async def _announce_forever(self) -> None:
        """Send Ready on every (re)connection: the frontend may be a new process that has
        never heard of us. The first one follows model load and warm-up."""
        async for _ in self._channel.handshakes():
            await self._send(self._ready_message())

    async def _receive_forever(self) -> None:
        while True:
            received = await self._channel.receiver.get()
            self._inbox.append(received.msg)
            self._wakeup.set()

    async def _tick_forever(self) -> None:
        """Wake the loop while hand-offs are in flight, so leases end on time when idle."""
        while True:
            await asyncio.sleep(_HANDOFF_TICK_S)
            if self._sender.has_work:
                self._wakeup.set()

    async def _heartbeat_forever(self) -> None:
        """Heartbeats, and Ready again every few of them: a frontend that refused our Ready
        while a predecessor with our id still looked alive accepts it once that one is gone."""
        pid = os.getpid()
        for num_sent in itertools.count(1):
            await self._send(Heartbeat(self.worker_id, self._current_stats(), time.time(), pid))
            if num_sent % _REANNOUNCE_EVERY == 0:
                await self._send(self._ready_message())
            await asyncio.sleep(self._heartbeat_s)

    def _refresh_stats(self) -> None:
        """Snapshot the core's stats (between steps only: the core is not thread-safe).
        Not after every step: a snapshot costs milliseconds (KV and cost-model metrics),
        which a batch-1 step of ~15 ms would pay every time."""
        self._stats = self._core.stats()
        self._stats_time = time.monotonic()

    def _current_stats(self) -> WorkerStats:
        """The core's stats, read only between steps (the last snapshot while one runs)."""
        if not self._is_stepping:
            self._refresh_stats()
        handoff = intake = None
        if self._sender is not None:
            handoff = HandoffStats(**self._sender.counters,
                                   blocks_pinned=self._sender.num_pinned_blocks)
        if self._intake is not None:
            intake = IntakeStats(**self._intake.counters,
                                 rejected_kv_frames=self._intake.num_rejected)
        return msgspec.structs.replace(
            self._stats, num_rejected_frames=self._channel.receiver.num_rejected,
            handoff=handoff, intake=intake)

    # ------------------------------------------------------------------ plumbing
    def _ready_message(self) -> Ready:
        core = self._core
        return Ready(self.worker_id, self.role, core.model_name, core.max_model_len,
                     core.block_size, core.num_kv_blocks,
                     batch_invariant=self.config.batch_invariant,
                     speculation=self.config.spec.speculation, pid=os.getpid(),
                     kv_address=self._intake.address if self._intake else "",
                     model_identity=core.model_identity,
                     kv_dtype=self.config.weights_dtype if core.model_identity else "",
                     kv_layout=core.kv_layout, num_threads=core.num_threads,
                     weights=core.weights_label,
                     kv_shared=store_identity(self.config.cache.kv_remote))

    async def _in_core_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _send(self, msg: msgspec.Struct) -> None:
        await self._channel.sender.put(msg)

    async def _send_error(self, message: str) -> None:
        try:
            await asyncio.wait_for(self._send(WorkerError(self.worker_id, message)), 1.0)
        except Exception:  # noqa: BLE001 - the socket may be the thing that broke
            log.exception("worker %s: could not send WorkerError", self.worker_id)


def _final_delta(req_id: str, finish_reason: FinishReason, error: str,
                 kind: str = "") -> RequestDelta:
    return RequestDelta(req_id, [], finish_reason=finish_reason, error=error, error_kind=kind)


def _describe(error: BaseException) -> str:
    """One line for WorkerError; a TaskGroup's ExceptionGroup is unwrapped to its first cause."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"

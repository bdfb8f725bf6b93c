"""The engine worker: one asyncio loop serving one EngineCore over one ZMQ channel.

Owns the core (nothing else calls it), the deadlines of the requests it has admitted
(engine/deadlines.py) and the inbox of messages that arrived while a step was running; its
channel to the frontend is a WorkerLink (engine/worker_link.py), its KV hand-off side a
HandoffSides (engine/worker_handoff.py). Which
requests run is the core's to say (`has_request`); the core also reports every request's end,
an abort included, so each stream gets exactly one final delta.

Roles: a unified worker runs requests to their end. A prefill worker runs a request that names
a decode worker (`handoff_to`) up to its first token and hands its KV over
(`engine.kv_transfer.KVSender`); a decode worker binds a KV door and continues what prefill
workers hand it (`KVIntake`). A role whose KV cannot be handed over (hybrid sliding-window
KV) is refused at start-up. Any worker runs a request without `handoff_to` to its end, so a
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
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import msgspec
import zmq
import zmq.asyncio

from duplex.engine.config import EngineConfig
from duplex.engine.curve import CurveKeys
from duplex.engine.deadlines import DEADLINE_ERROR, Deadlines
from duplex.engine.kv_transfer import prefill_part
from duplex.engine.messages import (INVALID, AbortRequests, AddRequest, FinishReason, Outputs, Ready,
                             RequestDelta, Shutdown, WorkerStats)
from duplex.engine.request_checks import check_add_request
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.worker_handoff import HandoffSides, check_role
from duplex.engine.worker_link import WorkerLink
from duplex.engine.zmq_io import new_context, worker_channel
from duplex.kvstore.shared import store_identity

if TYPE_CHECKING:  # torch stays unloaded in workers on fake cores
    from duplex.engine.cost_model import CostModel
    from duplex.engine.kv_manager import KVCacheManager
    from duplex.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

__all__ = ["DEADLINE_ERROR", "SHUTDOWN_ERROR", "Worker", "check_role", "role_config"]
SHUTDOWN_ERROR = "worker shutting down"
_STATS_REFRESH_S = 0.1  # most age of the stats snapshot heartbeats carry while stepping


def role_config(config: EngineConfig) -> EngineConfig:
    """A decode worker receives KV blocks into its host tier: it gets one (as large as the
    device pool) when none is configured."""
    cache = config.cache
    if config.worker.role == "decode" and cache.enable_prefix_caching and cache.kv_host_bytes <= 0:
        return config.replace(kv_host_bytes=cache.kv_cache_bytes)
    return config


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
    vocab_size: int | None  # token ids are checked against it (None: not checked, fakes)
    cost_model: CostModel | None  # step-time model, saved by `duplex worker --cost-model-out`
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
    """Serves `config` with the core `core_factory` builds from it; its role, heartbeat, KV
    door and hand-off lease are `config.worker`. `address`, `worker_id` and `keys` say who
    it is and where it connects (per process, a key is a secret: not config)."""

    def __init__(self, config: EngineConfig, core_factory: CoreFactory, *, address: str,
                 worker_id: str, step_in_thread: bool = True,
                 keys: CurveKeys | None = None) -> None:
        self.config = config
        self.worker_id = worker_id
        self.role = config.worker.role
        self._core_factory = core_factory
        self._address = address
        self._step_in_thread = step_in_thread  # False only to measure what the thread costs
        self._keys = keys  # CURVE on the worker channel and the KV door (engine.curve)
        self._ctx: zmq.asyncio.Context | None = None
        self._link: WorkerLink | None = None
        self._handoff = HandoffSides()  # the role's side once the core is up
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="core")
        self._core: Core | None = None
        self._inbox: deque[msgspec.Struct] = deque()
        self._wakeup = asyncio.Event()
        self._outbox: list[RequestDelta] = []  # deltas made between steps, sent with the next
        self._lifetime = _Lifetime()
        self._is_stepping = False
        self._snapshot = _StatsSnapshot(min(config.worker.heartbeat_s / 2, _STATS_REFRESH_S))

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> int:
        """Serve until Shutdown (returns 0) or a fatal error (sends WorkerError, returns 1)."""
        ctx = self._ctx = new_context()
        self._link = WorkerLink(worker_channel(ctx, self._address, self.worker_id, self._keys),
                                self.worker_id, self.config.worker.heartbeat_s)
        try:
            await self._start_core()
            await self._serve_with_background_tasks()
            return 0
        except Exception as e:  # noqa: BLE001 - every failure must become a WorkerError
            log.exception("worker %s failed", self.worker_id)
            await self._link.send_error(_describe(e))
            return 1
        finally:
            await self._close_core()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._handoff.close()
            self._link.close()
            ctx.term()

    @property
    def core(self) -> Core | None:
        """The engine, read-only for callers (e.g. to save its cost model after `run`)."""
        return self._core

    def request_shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Same as receiving Shutdown (for signal handlers)."""
        self._post(Shutdown(drain_timeout_s=drain_timeout_s))

    async def _start_core(self) -> None:
        self._core = await self._in_core_thread(self._core_factory, self.config)
        await self._in_core_thread(_warm_up, self._core, self.worker_id)
        self._snapshot.stats = self._core.stats()
        self._handoff = HandoffSides.for_role(
            self._core, self.config.worker, self._ctx, self.worker_id, wakeup=self._wakeup.set,
            deliver=lambda req: self._post(_HandedOver(req)), keys=self._keys)

    async def _close_core(self) -> None:
        """Let the core flush and release what it holds (KV writes, an EP group), in its own
        thread; skipped while a step is still in flight there."""
        if self._core is None or self._is_stepping:
            return
        try:
            await asyncio.wait_for(self._in_core_thread(self._core.close), 10.0)
        except Exception:  # noqa: BLE001 - exiting anyway
            log.exception("worker %s: closing the core failed", self.worker_id)

    async def _serve_with_background_tasks(self) -> None:
        link = self._link
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coro) for coro in (
                link.announce_forever(self._ready_message), link.receive_forever(self._post),
                link.heartbeat_forever(self._current_stats, self._ready_message),
                *self._handoff.background_tasks(self._wakeup.set))]
            await self._serve()
            for task in tasks:
                task.cancel()

    # ------------------------------------------------------------------ the loop
    async def _serve(self) -> None:
        while not self._is_done():
            await self._wait_for_work()
            self._apply_inbox()  # add / abort / shutdown, only between steps
            self._abort_overdue()
            await self._handoff.pump(self._link.send)  # offers go out before first steps
            if self._core.has_unfinished_requests():
                self._outbox += await self._step()
            if self._outbox:
                deltas, self._outbox = self._outbox, []
                await self._link.send(Outputs(self.worker_id, deltas))
            await self._handoff.pump(self._link.send)  # blocks the step completed, KvDone

    def _is_done(self) -> bool:
        return (self._lifetime.is_shutting_down and not self._inbox
                and not self._core.has_unfinished_requests())

    async def _wait_for_work(self) -> None:
        """Block while idle: no spin, the next message wakes us."""
        self._wakeup.clear()
        if not self._inbox and not self._core.has_unfinished_requests():
            await self._wakeup.wait()

    def _post(self, msg) -> None:
        """Into the inbox (a message, a handed-over request), applied between steps."""
        self._inbox.append(msg)
        self._wakeup.set()

    def _apply_inbox(self) -> None:
        while self._inbox:
            match self._inbox.popleft():
                case AddRequest() as req:
                    self._add(req)
                case _HandedOver(msg=req):  # run it, then acknowledge: the prefill side frees
                    self._handoff.acknowledge(req.req_id, self._add(req))
                case AbortRequests(req_ids=req_ids):
                    self._abort(req_ids, error="")
                    self._handoff.forget(req_ids)
                case Shutdown(drain_timeout_s=drain_s):
                    self._lifetime.begin_shutdown(drain_s, self.worker_id)

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
        self._snapshot.refresh_if_stale(self._core)  # for heartbeats during the next steps
        return self._handoff.after_step(deltas)  # pins handed-off blocks at once

    # ------------------------------------------------------------------ requests
    def _add(self, req: AddRequest) -> bool:
        """Admit req; False (after an error delta) if it cannot run. A request already
        running here is a resume that raced with its own hand-off: it keeps running."""
        if self._core.has_request(req.req_id) and (req.output_token_ids or self._handoff.intake):
            log.info("worker %s: %s already runs here", self.worker_id, req.req_id)
            return True
        is_handoff = self._handoff.will_hand_off(req)
        self._handoff.cancel([req.req_id])  # added again: it supersedes its old hand-off
        error, kind = self._lifetime.admission_error(req), ""
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
        self._lifetime.admit(req)
        if is_handoff:
            self._handoff.start(req)
        return True

    def _abort(self, req_ids: list[str], *, error: str) -> None:
        """Abort those of `req_ids` the core still runs; the core reports each one's end
        (finish "abort" with `error`) among the next step's deltas."""
        live = [req_id for req_id in dict.fromkeys(req_ids) if self._core.has_request(req_id)]
        if not live:
            return
        self._core.abort_requests(live, error=error)
        self._handoff.cancel(live)

    def _abort_overdue(self) -> None:
        """Requests past their deadline, and every request once a shutdown's drain is over."""
        self._abort(self._lifetime.expired(), error=DEADLINE_ERROR)
        if self._lifetime.is_drain_over():
            self._abort(self._core.request_ids(), error=SHUTDOWN_ERROR)

    # ------------------------------------------------------------------ reporting
    def _current_stats(self) -> WorkerStats:
        """The core's stats, read only between steps (the last snapshot while one runs)."""
        if not self._is_stepping:
            self._snapshot.refresh(self._core)
        handoff, intake = self._handoff.stats()
        return msgspec.structs.replace(self._snapshot.stats,
                                       num_rejected_frames=self._link.num_rejected,
                                       handoff=handoff, intake=intake)

    def _ready_message(self) -> Ready:
        core = self._core
        return Ready(self.worker_id, self.role, core.model_name, core.max_model_len,
                     core.block_size, core.num_kv_blocks,
                     batch_invariant=self.config.batch_invariant,
                     speculation=self.config.spec.speculation, pid=os.getpid(),
                     kv_address=self._handoff.address, model_identity=core.model_identity,
                     kv_dtype=core.kv_format if core.model_identity else "",
                     kv_layout=core.kv_layout, num_threads=core.num_threads,
                     weights=core.weights_label,
                     kv_shared=store_identity(self.config.cache.kv_remote))

    async def _in_core_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


class _Lifetime:
    """When admitted requests must end: at their deadline (engine/deadlines.py), or all of
    them once a shutdown's drain time is up; and which new ones are refused for it."""

    def __init__(self) -> None:
        self._deadlines = Deadlines()
        self._drain_until: float | None = None  # set by Shutdown: time.monotonic() limit

    @property
    def is_shutting_down(self) -> bool:
        return self._drain_until is not None

    def admission_error(self, req: AddRequest) -> str | None:
        if self._drain_until is not None:
            return SHUTDOWN_ERROR
        if self._deadlines.is_past(req.deadline):
            return DEADLINE_ERROR
        return None

    def admit(self, req: AddRequest) -> None:
        self._deadlines.add(req.req_id, req.deadline)

    def expired(self) -> list[str]:
        return self._deadlines.pop_expired()

    def begin_shutdown(self, drain_timeout_s: float, worker_id: str) -> None:
        if self._drain_until is None:
            log.info("worker %s: shutdown, draining for up to %.1f s", worker_id,
                     drain_timeout_s)
            self._drain_until = time.monotonic() + max(drain_timeout_s, 0.0)

    def is_drain_over(self) -> bool:
        return self._drain_until is not None and time.monotonic() >= self._drain_until


class _StatsSnapshot:
    """The core's stats as last read (between steps only: the core is not thread-safe).
    Not after every step: a snapshot costs milliseconds (KV and cost-model metrics), which
    a batch-1 step of ~15 ms would pay every time."""

    def __init__(self, refresh_s: float) -> None:
        self.stats = WorkerStats()
        self._refresh_s = refresh_s  # most age of the snapshot heartbeats carry while stepping
        self._time = 0.0

    def refresh(self, core: Core) -> None:
        self.stats = core.stats()
        self._time = time.monotonic()

    def refresh_if_stale(self, core: Core) -> None:
        if time.monotonic() - self._time >= self._refresh_s:
            self.refresh(core)


def _warm_up(core: Core, worker_id: str) -> None:
    """One tiny request through the whole path, so the first real step is not the slowest."""
    req = AddRequest(f"warmup-{worker_id}", [0], SamplingParams(temperature=0.0, max_tokens=1))
    core.add_request(req)
    for _ in range(16):
        if not core.has_unfinished_requests():
            return
        core.step()
    core.abort_requests([req.req_id])
    core.step()  # takes the abort's final delta: no stream waits for it


def _final_delta(req_id: str, finish_reason: FinishReason, error: str,
                 kind: str = "") -> RequestDelta:
    return RequestDelta(req_id, [], finish_reason=finish_reason, error=error, error_kind=kind)


def _describe(error: BaseException) -> str:
    """One line for WorkerError; a TaskGroup's ExceptionGroup is unwrapped to its first cause."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"

"""HandoffSides: the KV hand-off side of one worker, as its role gives it.

A prefill worker holds a `KVSender` (it runs a request that names a decode worker up to its
first token, then hands the KV over); a decode worker holds a `KVIntake` (it binds a KV door
and continues what prefill workers hand it); a unified worker, or a core without a runner
and KV manager of its own (the expert-parallel group), holds neither and serves every
request itself. The worker (engine/worker.py) owns one and calls it between steps only.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable

from duplex.engine.kv_transfer import KVIntake, KVSender
from duplex.engine.messages import AddRequest, RequestDelta
from duplex.engine.stats import HandoffStats, IntakeStats

if TYPE_CHECKING:
    import zmq.asyncio

    from duplex.engine.config import WorkerConfig
    from duplex.engine.curve import CurveKeys

_TICK_S = 0.25  # how often leases are checked while hand-offs are in flight


def check_role(core, role: str) -> None:
    """Refuse a prefill or decode role for a core whose KV cannot be handed over (hybrid
    sliding-window KV) instead of quietly serving as a unified worker."""
    if role != "unified" and core.runner is not None and core.layout is not None:
        raise ValueError(f"a {role} worker cannot hand over hybrid (sliding-window) KV: serve "
                         "this model with --no-hybrid-kv, or with one unified worker")


class HandoffSides:
    def __init__(self, sender: KVSender | None = None, intake: KVIntake | None = None) -> None:
        self.sender = sender
        self.intake = intake

    @classmethod
    def for_role(cls, core, options: WorkerConfig, ctx: zmq.asyncio.Context, worker_id: str,
                 *, wakeup: Callable[[], None], deliver: Callable[[AddRequest], None],
                 keys: CurveKeys | None) -> HandoffSides:
        """The side of `options.role` on `core`'s KV cache; `deliver` takes each request
        handed over to a decode worker, `wakeup` wakes the worker loop when a hand-off
        needs it."""
        role = options.role
        check_role(core, role)
        if core.runner is None or role == "unified":
            return cls()
        if role == "prefill":
            return cls(sender=KVSender(core.kv.handoff, core.runner.kv, core.max_model_len,
                                       ctx, worker_id, wakeup=wakeup,
                                       lease_s=options.handoff_lease_s,
                                       keys=keys, platform=core.platform))
        return cls(intake=KVIntake(core.kv.handoff, core.runner.kv, ctx, options.kv_bind,
                                   deliver=deliver, is_live=core.has_request, keys=keys))

    @property
    def address(self) -> str:
        """The decode side's KV door ("" for the others)."""
        return self.intake.address if self.intake is not None else ""

    def background_tasks(self, wakeup: Callable[[], None]) -> list[Awaitable[None]]:
        """What runs beside the worker loop: the KV door, or the prefill side's lease tick."""
        if self.intake is not None:
            return [self.intake.serve_forever()]
        if self.sender is not None:
            return [self._tick_forever(wakeup)]
        return []

    async def _tick_forever(self, wakeup: Callable[[], None]) -> None:
        """Wake the loop while hand-offs are in flight, so leases end on time when idle."""
        while True:
            await asyncio.sleep(_TICK_S)
            if self.sender.has_work:
                wakeup()

    # ------------------------------------------------------------------ requests
    def will_hand_off(self, req: AddRequest) -> bool:
        return self.sender is not None and bool(req.handoff_to)

    def start(self, req: AddRequest) -> None:
        """Begin handing req off once its prompt is computed (a prefill worker's)."""
        self.sender.start(req)

    def cancel(self, req_ids: list[str]) -> None:
        """Hand-offs of these requests no longer happen (added again, aborted, ended)."""
        if self.sender is not None:
            self.sender.cancel(req_ids)

    def forget(self, req_ids: list[str]) -> None:
        """An abort from the frontend: drop whatever either side still holds for them."""
        self.cancel(req_ids)
        if self.intake is not None:
            self.intake.forget(req_ids)

    def acknowledge(self, req_id: str, admitted: bool) -> None:
        """Tell the prefill side whether a handed-over request runs here (it then frees)."""
        if admitted:
            self.intake.accepted(req_id)
        else:
            self.intake.refused(req_id, "could not be admitted")

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """The step's deltas, with handed-off blocks pinned at once (prefill side)."""
        return self.sender.after_step(deltas) if self.sender is not None else deltas

    async def pump(self, send: Callable[[object], Awaitable[None]]) -> None:
        """Move hand-offs on: offers and blocks out, failures to the frontend, KvDone back."""
        if self.sender is not None:
            for failure in await self.sender.pump():
                await send(failure)
        if self.intake is not None:
            await self.intake.flush()

    # ------------------------------------------------------------------ reporting
    def stats(self) -> tuple[HandoffStats | None, IntakeStats | None]:
        handoff = intake = None
        if self.sender is not None:
            handoff = HandoffStats(**self.sender.counters,
                                   blocks_pinned=self.sender.num_pinned_blocks)
        if self.intake is not None:
            intake = IntakeStats(**self.intake.counters,
                                 rejected_kv_frames=self.intake.num_rejected)
        return handoff, intake

    def close(self) -> None:
        for side in (self.sender, self.intake):
            if side is not None:
                side.close()

"""Scheduler: decides what runs in the next step.

Every request just has computed tokens catching up with its tokens; the scheduler hands
out a per-step token budget, running requests first (oldest first), then waiting ones in
arrival order as KV blocks allow. Long prompts are chunked to the budget. When the pool
runs dry, the newest running request is preempted: its blocks are freed and it later
recomputes (its prompt is then prompt + output so far, which is the same counter model).

With a prefill order (engine.step_policy.shortest_first, served workers), decoding requests
still come first, a token each; then the prompts, running and waiting alike, take the rest
of the budget in the order's place, lowest first: a short prompt is not queued behind a long
one, and a long one mid-way waits a step for it. A prompt that cannot get blocks then is
passed over, not preempted for; only a step in which nothing fits falls back to the arrival
order, which preempts.

A waiting request whose cached prefix is still being read from disk is passed over, so
the reads overlap other requests' compute; only an otherwise idle step waits for them.

With overlapped scheduling (engine/core.py) a request may carry placeholder tokens, drawn
by the step in flight: a running one is scheduled on (its next token's id comes from the
device), except when those placeholders already end it by length; a waiting one (it was
preempted by this very schedule) waits until they land.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple

from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.request import Request, Status


class ScheduledRequest(NamedTuple):
    req: Request
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


# (scheduler) -> this step's token budget, e.g. engine.step_policy.time_budget
TokenBudget = Callable[["Scheduler"], int]
# (scheduler, req, now) -> the prompt's place in line this step, lowest first, e.g.
# engine.step_policy.shortest_first (ties go by arrival)
PrefillOrder = Callable[["Scheduler", Request, float], float]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, *, token_budget: TokenBudget | None = None,
                 prefill_order: PrefillOrder | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._token_budget_fn = token_budget  # None: max_num_batched_tokens every step
        self._prefill_order_fn = prefill_order  # None: running, then waiting by arrival

    # ------------------------------------------------------------------ queues
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take req out of the queues and release its blocks (EngineCore.finish)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self._token_budget()
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        if self._prefill_order_fn is not None:
            self._schedule_ordered(budget, scheduled, preempted)
            return SchedulerOutput(scheduled, preempted)
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
            if not scheduled and self.kv.wait_for_loads(self.waiting):
                self._schedule_waiting(budget, scheduled)  # idle: waited for a disk read
        return SchedulerOutput(scheduled, preempted)

    def _schedule_ordered(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[Request]) -> None:
        left = self._schedule_running(budget, scheduled, preempted, prompts=False)
        self._schedule_prompts(left, scheduled, admit=not preempted)
        if scheduled or preempted:
            return
        if self.kv.wait_for_loads(self.waiting):  # idle: wait for a disk read
            self._schedule_prompts(left, scheduled, admit=True)
        if not scheduled:  # nothing fits as it stands: the arrival order preempts for room
            budget = self._schedule_running(budget, scheduled, preempted)
            if not preempted:
                self._schedule_waiting(budget, scheduled)

    def _token_budget(self) -> int:
        if self._token_budget_fn is not None:
            return max(1, min(self.max_num_batched_tokens, self._token_budget_fn(self)))
        return self.max_num_batched_tokens

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[Request], prompts: bool = True) -> int:
        """Running requests oldest first (decoding ones only, unless `prompts`), each as many
        tokens as it has and the budget leaves; the newest are preempted for blocks."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and ends_by_length(req, self.max_model_len):
                i += 1  # its last token is drawn already: nothing more to compute
                continue
            if not prompts and not req.is_decoding:
                i += 1  # a prompt mid-way: _schedule_prompts places it
                continue
            num_new = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens,
                          budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_prompts(self, budget: int, scheduled: list[ScheduledRequest],
                          admit: bool) -> None:
        """Prompts mid-way and (if `admit`) waiting requests, lowest place first, each as
        many tokens as the budget leaves; one that cannot get blocks is passed over."""
        now = time.time()
        running = [r for r in self.running if not r.is_decoding]
        waiting = [r for r in self.waiting
                   if admit and not (self.kv.is_loading(r) or r.num_pending)]
        place = self._prefill_order_fn
        order = sorted(running + waiting, key=lambda r: (place(self, r, now), r.arrival_time))
        for req in order:
            if budget <= 0:
                return
            if req.status is Status.RUNNING:
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.kv.allocate_slots(req, num_new):
                    continue
            elif len(self.running) >= self.max_num_seqs:
                continue
            else:
                num_new = self._admit(req, budget)
                if num_new is None:
                    continue
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        """Admit waiting requests in arrival order; one whose disk reads are still in flight
        is passed over (not waited for) and admitted once they land."""
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if self.kv.is_loading(req) or req.num_pending:
                continue
            num_new = self._admit(req, budget)
            if num_new is None:
                return
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _admit(self, req: Request, budget: int) -> int | None:
        """Give a waiting request its cached prefix and slots for up to budget more tokens;
        the number of tokens it computes this step, or None if the pool is too full."""
        hit, loaded = [], []
        if req.num_computed_tokens == 0:  # only a request without KV takes a prefix hit
            hit = self.kv.find_cached_blocks(req)
            loaded = self.kv.find_tier_blocks(req, len(hit))
        restore = self.kv.restore_point(req, len(hit), len(loaded))
        num_new = min(req.num_tokens - max(req.num_computed_tokens, restore.num_computed),
                      budget)
        if not self.kv.allocate_slots(req, num_new, hit, loaded):
            return None
        if hit or loaded:
            req.restore_prefix(*restore)
        self.kv.record_hit(req, len(hit), loaded)
        self.waiting.remove(req)
        req.start_running(time.time())
        self.running.append(req)
        return num_new

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.preempt()
        self.num_preemptions += 1
        self.waiting.appendleft(req)


def ends_by_length(req: Request, max_model_len: int) -> bool:
    """Its tokens, placeholders included, reach max_tokens or the context: whatever their
    ids, the last of them ends it."""
    return req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len

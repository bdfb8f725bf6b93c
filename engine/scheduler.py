"""Scheduler: decides what runs in the next step.

Every request just has computed tokens catching up with its tokens; the scheduler hands
out a per-step token budget, running requests first (oldest first), then waiting ones in
arrival order as KV blocks allow. Long prompts are chunked to the budget. When the pool
runs dry, the newest running request is preempted: its blocks are freed and it later
recomputes (its prompt is then prompt + output so far, which is the same counter model).
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.kv_manager import KVCacheManager
from engine.request import Request, Status


class ScheduledRequest(NamedTuple):
    req: Request
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.token_budget_fn = None  # optional: () -> int, e.g. from a time-budget cost model

    # ------------------------------------------------------------------ queues
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take req out of the queues and release its blocks (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = Status.FINISHED

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self._token_budget()
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, preempted)

    def _token_budget(self) -> int:
        if self.token_budget_fn is not None:
            return max(1, min(self.max_num_batched_tokens, self.token_budget_fn()))
        return self.max_num_batched_tokens

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[Request]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
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

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.find_cached_blocks(req) if req.num_computed_tokens == 0 else []
            num_computed = max(req.num_computed_tokens, len(hit) * self.kv.block_size)
            num_new = min(req.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(req, num_new, hit):
                break
            if req.num_cached_tokens < 0:  # the first scheduling decides the reported hit
                req.num_cached_tokens = len(hit) * self.kv.block_size
                req.cached_tokens_by_tier = {"device": req.num_cached_tokens}
            self.kv.num_hit_tokens += len(hit) * self.kv.block_size
            self.kv.num_queried_tokens += req.num_tokens
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

"""How much one scheduler step may take on, and in what order: the time budget and the
shortest-first order of prompts.

Two policies the Scheduler is built with and calls with itself during a step (it owns
neither; EngineCore chooses them from SchedulerConfig):

* `time_budget(...)` -> `Scheduler(token_budget=...)`: the step's token budget is the decode
  tokens of the running requests plus as many prompt tokens as the cost model predicts fit
  in `--step-budget-ms` next to them (at least `min_chunk`, so prefill always progresses).
  Until the model has enough samples, the static `max_num_batched_tokens` applies.
* `shortest_first(...)` -> `Scheduler(prefill_order=...)`: prompts run shortest remaining
  first (after the cached prefix a waiting one would hit), each one's length divided by
  1 + its wait / `aging_s`, so a long prompt is not passed over for ever. A short prompt
  that arrives during a long prefill gets its first token within a step or two instead of
  after the whole long prompt, and a burst of prompts finishes its short ones first, which
  is what brings the median time to first token down; decoding requests keep their token
  every step (the worker-side half of length bucketing; the router holds the queues).
"""
from __future__ import annotations

import weakref
from typing import Callable

from duplex.engine.cost_model import CostModel, attended_pairs
from duplex.engine.request import Request

# A prompt chunk never shrinks below this many tokens (tiny chunks waste the weights read).
MIN_CHUNK = 16
# A waiting prompt counts half its length after this many seconds, a third after twice as
# long: on a busy CPU box a burst of prompts takes minutes, and a long one still gets its
# turn among shorter ones that keep arriving.
AGING_S = 120.0


def time_budget(model: CostModel, budget_s: float,
                min_chunk: int = MIN_CHUNK) -> Callable[[object], int]:
    def token_budget(scheduler) -> int:
        limit = scheduler.max_num_batched_tokens
        decoding = [r for r in scheduler.running if r.is_decoding]
        num_decode = len(decoding)
        decode_ktokens = sum(attended_pairs(r.num_tokens - 1, 1) for r in decoding) / 1000.0
        prompt = next((r for r in scheduler.running if not r.is_decoding), None)
        offset = prompt.num_computed_tokens if prompt is not None else 0
        tokens = model.max_prefill_tokens(budget_s, num_decode_seqs=num_decode,
                                          decode_ktokens=decode_ktokens,
                                          prefill_offset=offset, limit=limit - num_decode)
        if tokens is None:
            return limit
        return num_decode + max(min_chunk, tokens)
    return token_budget


def shortest_first(aging_s: float = AGING_S) -> Callable[[object, Request, float], float]:
    """A prompt's place in line: the tokens it has left to compute (for one not started,
    after the device prefix hit it would take), over 1 + seconds waited / aging_s. A waiting
    request's hit is looked up once (per length: a preempted one is looked up again), not
    every step: a stale hit only moves it in the line, and admission looks again."""
    hits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # req -> (tokens, hit)

    def place(scheduler, req: Request, now: float) -> float:
        done = req.num_computed_tokens
        if done == 0:
            seen = hits.get(req)
            if seen is None or seen[0] != req.num_tokens:
                hit = len(scheduler.kv.find_cached_blocks(req)) * scheduler.kv.block_size
                hits[req] = seen = (req.num_tokens, hit)
            done = seen[1]
        waited = max(0.0, now - req.arrival_time)
        return (req.num_tokens - done) / (1.0 + waited / aging_s)
    return place

"""How much one scheduler step may take on: the time budget and the fair prefill share.

Two policies the Scheduler is built with and calls with itself during a step (it owns
neither; EngineCore chooses them from SchedulerConfig):

* `time_budget(...)` -> `Scheduler(token_budget=...)`: the step's token budget is the decode
  tokens of the running requests plus as many prompt tokens as the cost model predicts fit
  in `--step-budget-ms` next to them (at least `min_chunk`, so prefill always progresses).
  Until the model has enough samples, the static `max_num_batched_tokens` applies.
* `fair_prefill(...)` -> `Scheduler(prefill_chunk=...)`: a running prompt's chunk leaves a
  token to each decoding request and, while requests wait, part of the budget to them, so
  a short prompt that arrives during a long prefill gets its first token within a step or
  two instead of after the whole long prompt, and running streams keep their pace (the
  worker-side half of length bucketing; the router holds the queues).
"""
from __future__ import annotations

from typing import Callable

from duplex.engine.cost_model import CostModel, attended_pairs
from duplex.engine.request import Request

# A prompt chunk never shrinks below this many tokens (tiny chunks waste the weights read).
MIN_CHUNK = 16


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


def fair_prefill(share: float = 0.5,
                 min_chunk: int = MIN_CHUNK) -> Callable[[object, Request, int], int]:
    """A running prompt's chunk leaves one token for every decoding request and, while
    requests wait, `share` of the budget to them; never less than min_chunk."""
    def chunk_limit(scheduler, req: Request, budget: int) -> int:
        reserve = sum(1 for r in scheduler.running if r.is_decoding)
        if scheduler.waiting:
            reserve += int(budget * share)
        return max(min_chunk, budget - reserve)
    return chunk_limit

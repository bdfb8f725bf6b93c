"""Sampler: logits of the requests that sample this step -> one token each (+ logprobs).

Order of processing, per row: min-tokens mask, penalties, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a draw. Draws use the exponential-race trick
(argmax(p / E), E ~ Exp(1)) with the request's own generator when it has a seed, so a
seeded request gets the same tokens whatever else is in the batch. Reported logprobs are
those of the model's raw distribution (before penalties and temperature).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from engine.messages import TokenLogprob
from engine.request import Request
from kernels import ops


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SamplerOutput:
        """logits: fp32 [num_reqs, vocab]."""
        raw = logits
        logits = logits.clone()
        for row, req in enumerate(reqs):
            _mask_early_stop(logits[row], req)
            if req.params.has_penalties:
                _apply_penalties(logits[row], req)
        token_ids = [self._choose(logits[row], req) for row, req in enumerate(reqs)]
        return SamplerOutput(token_ids, _logprobs(raw, reqs, token_ids))

    @staticmethod
    def logprobs(logits: torch.Tensor, reqs: Sequence[Request],
                 token_ids: list[int]) -> list[TokenLogprob | None]:
        """Logprobs of given tokens (e.g. verified drafts) under raw logits [n, vocab]."""
        return _logprobs(logits, reqs, token_ids)

    def _choose(self, logits: torch.Tensor, req: Request) -> int:
        params = req.params
        if params.is_greedy:
            return int(torch.argmax(logits))
        logits = logits / params.temperature
        logits = apply_top_k_top_p_min_p(logits, params.top_k, params.top_p, params.min_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=req.generator or self.generator)
        return int(torch.argmax(probs / noise))


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: int, top_p: float,
                            min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, outside the top-p nucleus, or below
    min_p x the top probability. logits: [vocab] (already temperature-scaled)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens strictly more likely already cover top_p
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def _mask_early_stop(logits: torch.Tensor, req: Request) -> None:
    """Before min_tokens outputs, EOS and stop tokens cannot be chosen."""
    if req.num_output_tokens >= req.params.min_tokens:
        return
    banned = list(req.params.stop_token_ids)
    if not req.params.ignore_eos:
        banned += list(req.eos_token_ids)
    if banned:
        logits[torch.tensor(banned)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, req: Request) -> None:
    """Repetition penalty (Hugging Face semantics, over prompt and output) and OpenAI
    presence / frequency penalties (over the output only), in place on one row."""
    params = req.params
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if req.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _logprobs(raw: torch.Tensor, reqs: Sequence[Request],
              token_ids: list[int]) -> list[TokenLogprob | None]:
    rows = [i for i, req in enumerate(reqs) if req.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(reqs)
    if not rows:
        return out
    logprobs = ops.log_softmax(raw[rows])  # [len(rows), vocab]
    for j, row in enumerate(rows):
        num_top = reqs[row].params.logprobs
        top: list[tuple[int, float]] = []
        if num_top:
            values, ids = torch.topk(logprobs[j], num_top)
            top = list(zip(ids.tolist(), values.tolist()))
        token = token_ids[row]
        out[row] = TokenLogprob(token, float(logprobs[j, token]), top)
    return out

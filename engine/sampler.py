"""Sampler: logits of the requests that sample this step -> one token each (+ logprobs).

Owns the sampling math of a step, batched over the rows of logits [num_reqs, vocab]: the
min-tokens mask, penalties, then greedy argmax or temperature -> top-k -> top-p -> min-p ->
a draw. Reported logprobs are those of the model's raw distribution (before penalties and
temperature). Every reduction is per row, so in batch-invariant mode a row's result does
not depend on the others.

Truncation gives each row the mask of the one-row reference `apply_top_k_top_p_min_p` bit
for bit (top-k keeps values >= the k-th; top-p sorts the row and drops a token once the
tokens sorted before it cover top_p; min-p drops p < min_p * p_max), without sorting rows:

* fast path (`_fast_cut`): the top candidates of each row (a superset of every token above
  a `floor`) decide the row when each verdict is farther from its threshold than a bound on
  the reference's own fp32 rounding, so the two cannot disagree; the result is a value
  threshold (keep x >= threshold).
* exact path (`_exact_kept`), for the other rows: the reference on whole rows. Top-p sorts
  the row's values with numpy (SIMD, values only, ~20x faster than torch.sort) to reproduce
  the reference's sums; only rows whose tied values straddle the boundary need the
  reference's own torch.sort order (`_reference_truncate`).

Draws: a seeded request draws as the reference does, argmax(p / E) with E ~ Exp(1) over the
full vocabulary from its own generator (re-seeded per output position, see
Request.generator): the same tokens as before, whatever else is in the batch. That noise is
most of a seeded row's cost (~1.5 ms per row at vocab 49152). Unseeded rows draw by inverse
CDF from one or two uniforms per row of the sampler's generator, over the candidates when
the kept tokens are all among them: the same distribution as before but not the same tokens
as the old per-row draws (which were never reproducible).
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np
import torch

from engine.grammar import TokenMask
from engine.messages import TokenLogprob
from engine.request import Request
from kernels import batch_invariant as bi
from kernels import ops

CHUNK_LEN = 16  # tokens per candidate chunk; chunk c of C holds the tokens c, c + C, ...
NUM_CHUNKS = 128  # chunks kept per row: NUM_CHUNKS * CHUNK_LEN candidates
ARGMAX_CHUNK = 64  # contiguous chunk of the two-level argmax
CDF_CHUNK = 256  # contiguous chunk of the two-level inverse-CDF draw
U32 = 2.0 ** -24  # fp32 unit roundoff
EXP_RTOL = 2e-6  # bound on the relative error of one fp32 exp (measured: 1.2e-7)
MIN_P_RTOL = 4 * EXP_RTOL + 8 * U32  # how close to min_p a ratio p / p_max is undecided
NEG_INF = float("-inf")


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request],
                 mask: TokenMask | None = None) -> SamplerOutput:
        """logits: fp32 [num_reqs, vocab]; not modified. mask: the tokens a grammar allows
        in some rows (engine/grammar.py); other rows are computed exactly as without it."""
        raw = logits
        logits = _apply_penalties(_mask_early_stop(logits, reqs), reqs)
        logits = apply_grammar_mask(_apply_logit_bias(logits, reqs), mask)
        greedy = [row for row, req in enumerate(reqs) if req.params.is_greedy]
        sampled = [row for row, req in enumerate(reqs) if not req.params.is_greedy]
        token_ids = torch.empty(len(reqs), dtype=torch.long)
        if greedy:
            token_ids[greedy] = _argmax(_rows(logits, greedy))
        if sampled:
            token_ids[sampled] = self._sample(_rows(logits, sampled), [reqs[i] for i in sampled])
        ids = token_ids.tolist()
        return SamplerOutput(ids, _logprobs(raw, reqs, ids))

    @staticmethod
    def logprobs(logits: torch.Tensor, reqs: Sequence[Request],
                 token_ids: list[int]) -> list[TokenLogprob | None]:
        """Logprobs of given tokens (e.g. verified drafts) under raw logits [n, vocab]."""
        return _logprobs(logits, reqs, token_ids)

    def _sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Non-greedy rows: logits [m, vocab] -> token ids [m]."""
        params = [req.params for req in reqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        xt = logits if bool((temperature == 1).all()) else logits / temperature[:, None]
        trunc = _Truncation.of([p.top_k for p in params], [p.top_p for p in params],
                               [p.min_p for p in params], xt.shape[-1])
        cut = _fast_cut(xt, trunc)
        kept = _kept(xt, trunc, cut)
        seeded = torch.tensor([p.seed is not None for p in params])
        in_candidates = (kept.by_value & (kept.threshold > cut.floor) & ~seeded).tolist()
        fast = [row for row, flag in enumerate(in_candidates) if flag]
        full = [row for row, flag in enumerate(in_candidates) if not flag]
        token_ids = torch.empty(len(reqs), dtype=torch.long)
        if fast:
            token_ids[fast] = self._draw_candidates(_select(cut, fast), kept.threshold[fast])
        if full:
            masked = _apply_kept(_rows(xt, full), _select(trunc, full), _select(kept, full))
            token_ids[full] = self._draw_full(masked, [reqs[i] for i in full])
        return token_ids

    def _draw_candidates(self, cut: _Cut, threshold: torch.Tensor) -> torch.Tensor:
        """Unseeded rows whose kept tokens (x >= threshold [f]) are all candidates: [f] ids."""
        values = cut.values  # [f, K]
        weights = torch.where(values >= threshold[:, None],
                              torch.exp(values - values.amax(-1, keepdim=True)), 0.0)
        pos = _inverse_cdf(weights, self.generator)  # [f]
        return cut.ids.gather(1, pos[:, None])[:, 0]

    def _draw_full(self, masked: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Rows drawn over the whole vocabulary: masked [f, vocab] -> [f] token ids."""
        probs = torch.softmax(masked, dim=-1)  # [f, vocab]
        seeded = [row for row, req in enumerate(reqs) if req.params.seed is not None]
        unseeded = [row for row, req in enumerate(reqs) if req.params.seed is None]
        token_ids = torch.empty(len(reqs), dtype=torch.long)
        if seeded:
            token_ids[seeded] = _race(_rows(probs, seeded), [reqs[i].generator for i in seeded])
        if unseeded:
            token_ids[unseeded] = _inverse_cdf(_rows(probs, unseeded), self.generator)
        return token_ids


# ------------------------------------------------------------------ truncation

class _Truncation(NamedTuple):
    """Per-row truncation parameters, in the dtypes the reference compares in."""
    top_k: torch.Tensor  # [n] int64; 0: off (the reference skips k <= 0 and k >= vocab)
    top_p: torch.Tensor  # [n] fp32; inf: off (a top_p < 1 may still round to fp32 1.0)
    min_p: torch.Tensor  # [n] fp32; 0: off

    @classmethod
    def of(cls, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float],
           vocab: int) -> _Truncation:
        return cls(torch.tensor([k if 0 < k < vocab else 0 for k in top_k], dtype=torch.long),
                   torch.tensor([p if p < 1.0 else float("inf") for p in top_p],
                                dtype=torch.float32),
                   torch.tensor(list(min_p), dtype=torch.float32))


class _Cut(NamedTuple):
    """The fast path's verdict per row, and the candidates it looked at."""
    is_certain: torch.Tensor  # [n] bool: keeping x >= threshold is the reference's mask
    threshold: torch.Tensor  # [n] fp32
    values: torch.Tensor  # [n, K] fp32 candidate values, unordered
    ids: torch.Tensor  # [n, K] their token ids (ids >= vocab are -inf padding)
    floor: torch.Tensor  # [n] fp32: every token above it is a candidate


class _Kept(NamedTuple):
    """The reference's kept tokens per row: x >= threshold where by_value, else only the
    reference's own sort order tells (tied values straddle top-p's boundary)."""
    threshold: torch.Tensor  # [n] fp32
    by_value: torch.Tensor  # [n] bool


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: int, top_p: float,
                            min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, outside the top-p nucleus, or below
    min_p x the top probability. logits: [vocab] or [n, vocab] (already temperature-scaled),
    one set of parameters for every row."""
    rows = logits.reshape(-1, logits.shape[-1])  # [n, vocab]
    n = rows.shape[0]
    trunc = _Truncation.of([top_k] * n, [top_p] * n, [min_p] * n, rows.shape[-1])
    return truncate(rows, trunc).view_as(logits)


def truncate(xt: torch.Tensor, trunc: _Truncation) -> torch.Tensor:
    """xt [n, vocab] temperature-scaled logits -> the reference's masked logits [n, vocab]."""
    return _apply_kept(xt, trunc, _kept(xt, trunc, _fast_cut(xt, trunc)))


def _kept(xt: torch.Tensor, trunc: _Truncation, cut: _Cut) -> _Kept:
    """The fast path's thresholds where it is certain, the exact path's elsewhere."""
    threshold = cut.threshold.clone()
    by_value = cut.is_certain.clone()
    rows = (~cut.is_certain).nonzero()[:, 0]
    if len(rows):
        exact = _exact_kept(_rows(xt, rows.tolist()), _select(trunc, rows))
        threshold[rows], by_value[rows] = exact.threshold, exact.by_value
    return _Kept(threshold, by_value)


def _apply_kept(xt: torch.Tensor, trunc: _Truncation, kept: _Kept) -> torch.Tensor:
    """Masked logits [n, vocab] from the kept thresholds (the reference itself where the
    kept set is not a threshold)."""
    out = _masked(xt, torch.where(kept.by_value, kept.threshold, NEG_INF))
    return _on_rows(out, ~kept.by_value,
                    lambda x, rows: _reference_truncate(x, _select(trunc, rows)))


def _fast_cut(xt: torch.Tensor, trunc: _Truncation) -> _Cut:
    """Decide each row from its candidates where the reference's verdict is certain.

    In the candidates sorted by value (u), the kept tokens are a prefix u[:n], n the
    smallest of the three cuts. A row is certain when (1) top-k's k-th value is above the
    floor, so it is exact; (2) every kept token passes each active cut by a margin, and at
    least one cut drops u[n] and everything below by a margin; (3) u[n - 1] is above
    u[n] and the floor, so the kept set is exactly {x >= u[n - 1]}, ties included.
    Top-p's margin bounds the reference's fp32 softmax sum, whose order we do not know.
    """
    assert xt.dtype in (torch.float32, torch.float64), "the rounding bounds assume fp32 or wider"
    values, ids, floor = _candidates(xt)  # [n, K], [n, K], [n]
    k_max = values.shape[1]
    u = _sort_desc(values)  # [n, K]
    floor_col = floor[:, None]  # [n, 1]
    u_ext = torch.cat([u, floor_col], 1)  # [n, K + 1]: anything past the candidates is <= floor
    row_max = u[:, :1]  # [n, 1]
    e = torch.exp((u_ext - row_max).double())  # [n, K + 1] the reference's exp, exactly

    has_k = trunc.top_k > 0
    in_k, exact_k = _top_k_candidates(u, floor_col, trunc.top_k)  # [n, K], [n]
    num_k = in_k.sum(-1)

    tp = trunc.top_p.double()[:, None]  # [n, 1]
    has_p = torch.isfinite(trunc.top_p)
    excl, tol_p = _exclusive_mass(xt, e[:, :-1] * in_k, has_p & ~has_k)
    num_p = torch.where(has_p, (excl[:, :-1] < tp).sum(-1), k_max)

    mp = trunc.min_p.double()[:, None]  # [n, 1]
    has_m = trunc.min_p > 0
    num_m = torch.where(has_m, (e[:, :-1] >= mp).sum(-1), k_max)

    num_kept = torch.minimum(torch.minimum(num_k, num_p), num_m)  # [n] >= 1
    last, nxt = (num_kept - 1)[:, None], num_kept[:, None]
    value_last = u.gather(1, last)
    value_next = torch.maximum(u_ext.gather(1, nxt), floor_col)  # the largest value dropped
    e_next = torch.exp((value_next - row_max).double())
    keeps = (exact_k[:, None]
             & (~has_p[:, None] | (excl.gather(1, last) < tp - tol_p))
             & (~has_m[:, None] | (e.gather(1, last) >= mp * (1 + MIN_P_RTOL))))
    drops = ((has_k & (num_kept == num_k))[:, None]
             | (has_p[:, None] & (excl.gather(1, nxt) >= tp + tol_p))
             | (has_m[:, None] & (e_next < mp * (1 - MIN_P_RTOL)))
             | (value_next == NEG_INF))
    is_certain = (keeps & drops & (value_last > value_next))[:, 0]
    return _Cut(is_certain, value_last[:, 0], values, ids, floor)


def _top_k_candidates(u: torch.Tensor, floor: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k on the sorted candidates u [n, K]: (in_k [n, K], the candidates it keeps;
    exact [n], whether u's k-th value is the row's: it is when above floor [n, 1])."""
    kth = u.gather(1, (k - 1).clamp(0, u.shape[1] - 1)[:, None])  # [n, 1]
    has_k = k > 0
    exact = ~has_k | ((k <= u.shape[1]) & (kth > floor)[:, 0])
    return ~has_k[:, None] | (u >= kth), exact


def _candidates(xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tokens of its NUM_CHUNKS chunks with the largest maxima (values [n, K],
    ids [n, K]) and floor [n], the largest maximum left out: every token above it is in."""
    n, vocab = xt.shape
    num_chunks = -(-vocab // CHUNK_LEN)
    if num_chunks <= NUM_CHUNKS:  # a small vocabulary: every token
        return xt, torch.arange(vocab).expand(n, vocab), torch.full((n,), NEG_INF)
    pad = num_chunks * CHUNK_LEN - vocab
    padded = torch.nn.functional.pad(xt, (0, pad), value=NEG_INF) if pad else xt.contiguous()
    chunk_max = padded.view(n, CHUNK_LEN, num_chunks).amax(1).numpy()  # [n, C]
    order = np.argpartition(chunk_max, num_chunks - NUM_CHUNKS - 1, axis=-1)  # [n, C]
    floor = np.take_along_axis(chunk_max, order[:, -NUM_CHUNKS - 1:-NUM_CHUNKS], axis=-1)
    chunks = torch.from_numpy(order[:, -NUM_CHUNKS:])  # [n, NUM_CHUNKS]
    offsets = torch.arange(CHUNK_LEN)[:, None] * num_chunks  # [L, 1]
    ids = (chunks[:, None, :] + offsets).reshape(n, -1)  # [n, L * NUM_CHUNKS]
    return padded.gather(1, ids), ids, torch.from_numpy(floor[:, 0])


def _exclusive_mass(xt: torch.Tensor, w: torch.Tensor,
                    whole_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's view of the sorted candidates: excl [n, K + 1], the probability mass before
    each position (the last entry: all the candidates), and tol [n, 1], a bound on how far
    the reference's fp32 value of it can be from ours.

    w [n, K] f64: the candidates' exp(x - max) that top-k keeps. The denominator is their
    sum, but the sum over the whole row where whole_row [n] (top-p without top-k).
    """
    total = _row_sum(w)  # [n]
    rel_err = _rounding_bound_(w / total[:, None])  # [n]
    rows = whole_row.nonzero()[:, 0]
    if len(rows):
        probs = torch.softmax(_rows(xt, rows.tolist()), dim=-1)  # [r, vocab]
        total[rows] = 1 / probs.amax(-1).double()  # p_max = exp(0) / sum
        rel_err[rows] = _rounding_bound_(probs).double()
    excl = torch.cat([torch.zeros_like(w[:, :1]), w.cumsum(-1)], 1) / total[:, None]
    # ours and the reference's sums each err by <= rel_err; exps and fp32 steps add the rest
    return excl, (2.02 * rel_err + 4 * EXP_RTOL + 8 * U32)[:, None]


def _rounding_bound_(probs: torch.Tensor) -> torch.Tensor:
    """Relative error bound of any fp32 summation of a row's terms, given them as fractions
    probs [r, V] of their sum (clamped in place): adding a term errs by at most
    min(term, u * sum); up to 64 further steps (combining lanes, or a pairwise tree) by at
    most u * sum each. -> [r]"""
    return _row_sum(probs.clamp_(max=U32)) + 64 * U32


def _exact_kept(x: torch.Tensor, trunc: _Truncation) -> _Kept:
    """The reference on whole rows x [r, vocab], as thresholds. Top-p's verdicts need only
    the sorted values; they map back to tokens by value unless tied values straddle the
    boundary (by_value False)."""
    threshold = torch.full((x.shape[0],), NEG_INF, dtype=x.dtype)
    by_value = torch.ones(x.shape[0], dtype=torch.bool)
    rows = (trunc.top_k > 0).nonzero()[:, 0].tolist()
    if rows:
        threshold[rows] = _kth(_rows(x, rows), trunc.top_k[rows])
    rows = torch.isfinite(trunc.top_p).nonzero()[:, 0].tolist()
    if rows:
        threshold[rows], by_value[rows] = _nucleus(_masked(_rows(x, rows), threshold[rows]),
                                                   trunc.top_p[rows])
    rows = ((trunc.min_p > 0) & by_value).nonzero()[:, 0].tolist()
    if rows:
        threshold[rows], by_value[rows] = _min_p_floor(
            _masked(_rows(x, rows), threshold[rows]), trunc.min_p[rows])
    return _Kept(threshold, by_value)


def _nucleus(x: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's top-p on x [r, vocab] (already top-k masked): (threshold [r],
    by_value [r])."""
    s = _sort_desc(x)  # [r, vocab]
    vocab = s.shape[-1]
    probs = torch.softmax(s, dim=-1)
    drop = torch.cumsum(probs, dim=-1).sub_(probs) >= top_p[:, None]  # [r, vocab], sorted
    num_kept = vocab - drop.sum(-1, keepdim=True)  # [r, 1]
    threshold = s.gather(1, num_kept - 1)
    next_value = torch.where(num_kept < vocab, s.gather(1, num_kept.clamp(max=vocab - 1)),
                             NEG_INF)
    is_suffix = ~(drop[:, :-1] > drop[:, 1:]).any(-1)  # the verdicts drop a tail
    return threshold[:, 0], is_suffix & (threshold > next_value)[:, 0]


def _min_p_floor(x: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's min-p on x [r, vocab] (already masked): (threshold [r], by_value [r])."""
    probs = torch.softmax(x, dim=-1)
    keep = ~(probs < min_p[:, None] * probs.amax(-1, keepdim=True))  # [r, vocab]
    threshold = torch.where(keep, x, float("inf")).amin(-1)
    return threshold, torch.where(keep, NEG_INF, x).amax(-1) < threshold


def _reference_truncate(x: torch.Tensor, trunc: _Truncation) -> torch.Tensor:
    """The reference itself on rows x [r, vocab], batched, top-p in torch.sort's order."""
    x = _on_rows(x, trunc.top_k > 0, lambda x, rows: _masked(x, _kth(x, trunc.top_k[rows])))
    x = _on_rows(x, torch.isfinite(trunc.top_p),
                 lambda x, rows: _sorted_top_p(x, trunc.top_p[rows]))
    return _on_rows(x, trunc.min_p > 0, lambda x, rows: _min_p_mask(x, trunc.min_p[rows]))


def _sorted_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [r, vocab]
    probs = torch.softmax(sorted_x, dim=-1)
    # drop a token when the tokens sorted before it already cover top_p
    drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return torch.where(drop, NEG_INF, x)


def _min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(x, dim=-1)  # [r, vocab]
    return torch.where(probs < min_p[:, None] * probs.amax(-1, keepdim=True), NEG_INF, x)


def _kth(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The k[i]-th largest value of each row of x [r, V] -> [r]."""
    return torch.topk(x, int(k.max())).values.gather(1, (k - 1)[:, None])[:, 0]


def _masked(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """x [r, V] with the values below threshold [r] set to -inf."""
    if bool((threshold == NEG_INF).all()):
        return x
    return torch.where(x < threshold[:, None], NEG_INF, x)


# ------------------------------------------------------------------ masks and penalties

def _mask_early_stop(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Before min_tokens outputs, EOS and stop tokens cannot be chosen."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[-1]
    for row, req in enumerate(reqs):
        if req.num_output_tokens >= req.params.min_tokens:
            continue
        eos = () if req.params.ignore_eos else req.eos_token_ids
        banned = [t for t in (*req.params.stop_token_ids, *eos) if t < vocab]
        rows += [row] * len(banned)
        cols += banned
    if not rows:
        return logits
    return logits.index_put((torch.tensor(rows), torch.tensor(cols)),
                            torch.tensor(NEG_INF, dtype=logits.dtype))


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Repetition penalty (Hugging Face semantics, over prompt and output) and OpenAI
    presence / frequency penalties (over the output only), on the rows that have any."""
    rows = [row for row, req in enumerate(reqs) if req.params.has_penalties]
    if not rows:
        return logits
    params = [reqs[i].params for i in rows]
    vocab = logits.shape[-1]
    x = logits[rows]  # [r, vocab]
    rep = _column([p.repetition_penalty for p in params])  # [r, 1]
    seen = _token_counts([reqs[i].all_token_ids for i in rows], vocab) > 0  # [r, vocab]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = _token_counts([reqs[i].output_token_ids for i in rows], vocab)  # [r, vocab]
    freq = _column([p.frequency_penalty for p in params])
    pres = _column([p.presence_penalty for p in params])
    x = torch.where(counts > 0, x - (freq * counts + pres), x)
    return logits.index_copy(0, torch.tensor(rows), x)


def _apply_logit_bias(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """OpenAI logit_bias: add each request's bias to its tokens' logits (ids >= vocab are
    ignored); rows without one are untouched."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[-1]
    for row, req in enumerate(reqs):
        for token_id, bias in req.params.logit_bias.items():
            if token_id < vocab:
                rows.append(row)
                cols.append(token_id)
                values.append(bias)
    if not rows:
        return logits
    return logits.index_put((torch.tensor(rows), torch.tensor(cols)),
                            torch.tensor(values, dtype=logits.dtype), accumulate=True)


def apply_grammar_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """Tokens a grammar rules out -> -inf, in the mask's rows only (a new tensor)."""
    if mask is None:
        return logits
    rows = torch.tensor(mask.rows)
    masked = torch.where(mask.allowed[:, :logits.shape[-1]], logits[rows], NEG_INF)
    return logits.index_copy(0, rows, masked)


def _token_counts(token_ids: Sequence[list[int]], vocab: int) -> torch.Tensor:
    """counts[i, t]: occurrences of token t in token_ids[i] (ids >= vocab ignored).
    [len(token_ids), vocab] fp32."""
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)),
                                   torch.tensor([len(ids) for ids in token_ids]))
    keep = flat < vocab
    counts = torch.zeros(len(token_ids), vocab)
    return counts.index_put_((rows[keep], flat[keep]), torch.ones(()), accumulate=True)


# ------------------------------------------------------------------ draws

def _argmax(x: torch.Tensor) -> torch.Tensor:
    """First index of each row's max, as torch.argmax, through chunk maxima (torch's CPU
    argmax over a long row is ~10x slower than amax). x: [n, vocab] -> [n]."""
    n, vocab = x.shape
    if vocab % ARGMAX_CHUNK:
        return torch.argmax(x, dim=-1)
    chunks = x.reshape(n, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)  # [n, C, L]
    first = torch.argmax(chunks.amax(-1), dim=-1)  # [n]: the first chunk holding the max
    inner = torch.argmax(chunks[torch.arange(n), first], dim=-1)  # [n]
    return first * ARGMAX_CHUNK + inner


def _race(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """The reference's seeded draw: argmax(p / E), E ~ Exp(1) over the whole row from the
    row's own generator. probs [s, vocab] -> [s]."""
    noise = torch.stack([torch.empty(probs.shape[-1], dtype=probs.dtype).exponential_(
        generator=g) for g in generators])  # [s, vocab]
    return _argmax(probs / noise)


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One categorical draw per row, P(i) = weights[i] / sum (weights >= 0, some > 0).
    weights [n, K] -> positions [n]; never one of weight 0. Wide rows go in two steps, a
    chunk by its mass and then a token inside it, so only one pass touches every weight."""
    n, width = weights.shape
    if width <= 4 * CDF_CHUNK:
        return _pick(weights.double(), torch.rand(n, 1, generator=generator, dtype=torch.float64))
    num_chunks = -(-width // CDF_CHUNK)
    pad = num_chunks * CDF_CHUNK - width
    chunks = torch.nn.functional.pad(weights, (0, pad)).view(n, num_chunks, CDF_CHUNK)
    uniforms = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    chunk = _pick(chunks.sum(-1, dtype=torch.float64), uniforms[:, :1])  # [n]
    inner = _pick(chunks[torch.arange(n), chunk].double(), uniforms[:, 1:])  # [n]
    return chunk * CDF_CHUNK + inner


def _pick(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """weights [n, K] f64, uniform [n, 1] in [0, 1) -> the position where the cumulative
    weight first exceeds uniform * total [n]."""
    cdf = weights.cumsum(-1)  # [n, K]
    total = cdf[:, -1:]
    pos = (cdf <= uniform * total).sum(-1)
    last = (cdf < total).sum(-1)  # the last position of weight > 0 (the target may round up)
    return torch.minimum(pos, last)


# ------------------------------------------------------------------ logprobs

def _logprobs(raw: torch.Tensor, reqs: Sequence[Request],
              token_ids: list[int]) -> list[TokenLogprob | None]:
    rows = [row for row, req in enumerate(reqs) if req.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(reqs)
    if not rows:
        return out
    logprobs = ops.log_softmax(_rows(raw, rows))  # [len(rows), vocab]
    chosen = torch.tensor([token_ids[row] for row in rows])[:, None]  # [len(rows), 1]
    chosen_logprobs = logprobs.gather(1, chosen)[:, 0].tolist()
    tops = _top_logprobs(logprobs, [reqs[row].params.logprobs for row in rows])
    for j, row in enumerate(rows):
        out[row] = TokenLogprob(token_ids[row], chosen_logprobs[j], tops[j])
    return out


def _top_logprobs(logprobs: torch.Tensor,
                  nums: list[int]) -> list[list[tuple[int, float]]]:
    """The top nums[j] (token, logprob) of each row of logprobs [r, vocab]; one topk per
    distinct count, so ties come out as from a one-row topk."""
    tops: list[list[tuple[int, float]]] = [[] for _ in nums]
    for num in set(nums) - {0}:
        rows = [j for j, n in enumerate(nums) if n == num]
        values, ids = torch.topk(_rows(logprobs, rows), num)  # [len(rows), num]
        for j, row_ids, row_values in zip(rows, ids.tolist(), values.tolist()):
            tops[j] = list(zip(row_ids, row_values))
    return tops


# ------------------------------------------------------------------ helpers

def _sort_desc(x: torch.Tensor) -> torch.Tensor:
    """Each row's values in descending order (values only). x: [r, V] fp32."""
    ascending = np.sort(x.detach().contiguous().numpy(), axis=-1)
    return torch.from_numpy(np.ascontiguousarray(ascending[:, ::-1]))


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """[r, V] -> [r]; a fixed tree of adds in batch-invariant mode."""
    return bi.tree_sum(x) if bi.is_batch_invariant() else x.sum(-1)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for an ascending row list, without a copy when it is every row."""
    return x if len(rows) == x.shape[0] else x[rows]


def _on_rows(x: torch.Tensor, active: torch.Tensor, fn) -> torch.Tensor:
    """x [n, V] with the rows where active [n] holds replaced by fn(x[rows], rows)."""
    rows = active.nonzero()[:, 0]
    if len(rows) == 0:
        return x
    if len(rows) == x.shape[0]:
        return fn(x, rows)
    return x.index_copy(0, rows, fn(x[rows], rows))


def _select(table: NamedTuple, rows):
    """The rows of a NamedTuple of per-row tensors."""
    return type(table)(*(t[rows] for t in table))


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None]

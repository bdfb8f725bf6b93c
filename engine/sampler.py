"""Sampler: logits of the requests that sample this step -> one token each (+ logprobs).

Owns the sampling math of a step, batched over the rows of logits [num_reqs, vocab]: the
min-tokens mask, penalties, logit bias and grammar masks, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> one draw (`kernels/cpu_sampler`: a C kernel on
the CPU, O(vocab) per row and no sort; its torch reference elsewhere). Reported logprobs
are those of the model's raw distribution (before penalties and temperature). Every
reduction is per row, so a row's result does not depend on the others.

Truncation keeps a value threshold per row, defined in exact arithmetic (float64 sums, a
tied group kept or dropped whole): see kernels/cpu_sampler.py. The one-row torch sampler
this replaced decided the top-p boundary by torch.sort's order and fp32 cumulative sums;
the two keep the same tokens except where fp32 rounding or a sort's tie order decided
(tests/engine/test_sampler.py measures how often).

Draws: inverse CDF over the kept tokens with one uniform per row. A seeded request's
uniform comes from (seed, output position) (`seeded_uniform`), so the token at
position i is the same wherever and whenever it is sampled, whatever else is in the batch,
and on any device; unseeded rows take theirs from the sampler's own numpy generator.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np
import torch

from duplex.engine.grammar import TokenMask
from duplex.engine.messages import TokenLogprob
from duplex.engine.platform import HostCopy
from duplex.engine.request import Request, position_seed
from duplex.kernels import cpu_sampler
from duplex.kernels import ops

ARGMAX_CHUNK = 64  # contiguous chunk of the two-level argmax
NEG_INF = float("-inf")
DRAW_SALT = 0x5DEECE66D
UNIFORM_POOL = 4096


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Draws:
    """One step's draws: `token_ids` [num_reqs] int64 on the device (what the next step of
    an overlapped schedule reads its inputs from), and their host copy in flight."""

    def __init__(self, token_ids: torch.Tensor, packed: _Packed) -> None:
        self.token_ids = token_ids
        self._packed = packed
        self._copy = HostCopy(packed.flat)

    def result(self) -> SamplerOutput:
        """The token ids and logprobs on the host: on a GPU, the wait for this step."""
        return SamplerOutput(*_unpack(self._copy.wait().tolist(), self._packed))


class _Rows(NamedTuple):
    """What one pass over a step's requests finds (each request's objects are cold in the
    caches after a forward, so the sampler walks them once): which rows are greedy and
    which sample, the sampled rows' kernel parameters, and which rows need any of the rarer
    steps."""
    greedy: list[int]
    sampled: list[int]
    params: np.ndarray  # [len(sampled), 5] f64: temperature, top_k, top_p, min_p, uniform
    seeded: list[int]  # positions in `sampled` whose uniform is their own (already set)
    early_stop: bool
    penalties: bool
    logit_bias: bool
    logprobs: list[int]


def _rows(reqs: Sequence[Request]) -> _Rows:
    greedy, sampled, seeded, logprobs, flat = [], [], [], [], []
    early = penalties = bias = False
    for row, req in enumerate(reqs):
        p = req.params
        if p.min_tokens and req.num_output_tokens < p.min_tokens:
            early = True
        penalties = penalties or p.has_penalties
        bias = bias or bool(p.logit_bias)
        if p.logprobs is not None:
            logprobs.append(row)
        if p.is_greedy:
            greedy.append(row)
            continue
        uniform = -1.0
        if p.seed is not None:
            seeded.append(len(sampled))
            uniform = seeded_uniform(req)
        sampled.append(row)
        flat += (p.temperature, p.top_k, p.top_p, p.min_p, uniform)
    params = np.array(flat, dtype=np.float64).reshape(len(sampled), cpu_sampler.NUM_PARAMS)
    return _Rows(greedy, sampled, params, seeded, early, penalties, bias, logprobs)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # speculative verification's
        self.rng = np.random.default_rng(seed)  # unseeded rows' uniforms
        self._pool = np.empty(0)  # the rng's next uniforms, drawn UNIFORM_POOL at a time

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request],
                 mask: TokenMask | None = None) -> SamplerOutput:
        """logits: fp32 [num_reqs, vocab]; not modified. mask: the tokens a grammar allows
        in some rows (engine/grammar.py); other rows are computed exactly as without it."""
        return self.launch(logits, reqs, mask).result()

    def launch(self, logits: torch.Tensor, reqs: Sequence[Request],
               mask: TokenMask | None = None) -> Draws:
        """The step's draws queued on the device, their copy to the host started and not
        waited for (`Draws.result` waits); arguments as for a call."""
        raw = logits
        rows = _rows(reqs)
        if rows.early_stop:
            logits = _mask_early_stop(logits, reqs)
        if rows.penalties:
            logits = _apply_penalties(logits, reqs)
        if rows.logit_bias:
            logits = _apply_logit_bias(logits, reqs)
        logits = apply_grammar_mask(logits, mask)
        if not rows.sampled:  # one kind of row: no scatter
            token_ids = _argmax(logits)
        elif not rows.greedy:
            token_ids = self._sample(logits, rows)
        else:
            token_ids = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
            token_ids[rows.greedy] = _argmax(take_rows(logits, rows.greedy))
            token_ids[rows.sampled] = self._sample(take_rows(logits, rows.sampled), rows)
        return Draws(token_ids, _pack(token_ids, raw, reqs, rows.logprobs))

    @staticmethod
    def logprobs(logits: torch.Tensor, reqs: Sequence[Request],
                 token_ids: list[int]) -> list[TokenLogprob | None]:
        """Logprobs of given tokens (e.g. verified drafts) under raw logits [n, vocab]."""
        rows = [row for row, req in enumerate(reqs) if req.params.logprobs is not None]
        ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        return _read_back(ids, logits, reqs, rows)[1]

    def _sample(self, logits: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """The sampled rows' logits [m, vocab] -> their token ids [m]. The parameters reach
        the C kernel as the one array _rows built."""
        self._fill_uniforms(rows.params[:, -1], rows.seeded)
        return _truncate(logits, rows.params)[0]

    def _fill_uniforms(self, uniform: np.ndarray, seeded: list[int]) -> None:
        """One uniform in [0, 1) per row: seeded rows already hold their own; the others
        take the generator's, in row order."""
        if not seeded:
            uniform[:] = self._next_uniforms(len(uniform))
            return
        unseeded = np.ones(len(uniform), dtype=bool)
        unseeded[seeded] = False
        uniform[unseeded] = self._next_uniforms(int(unseeded.sum()))

    def _next_uniforms(self, n: int) -> np.ndarray:
        """The generator's next n uniforms: the same stream as drawing n at a time, taken
        from a pool refilled UNIFORM_POOL at a time (one generator call in many steps)."""
        if len(self._pool) < n:
            self._pool = np.concatenate([self._pool, self.rng.random(max(n, UNIFORM_POOL))])
        out, self._pool = self._pool[:n], self._pool[n:]
        return out


def seeded_uniform(req: Request) -> float:
    """A seeded request's uniform in [0, 1) for this step's draw: 53 bits of
    position_seed(seed, output position), the same on any worker and any device for the
    same position (salted: Request.generator's stream, which speculation draws from, is
    seeded from the same pair)."""
    return (position_seed(req.params.seed ^ DRAW_SALT, req.num_output_tokens) >> 10) * 2.0 ** -53


# ------------------------------------------------------------------ truncation

def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: int, top_p: float,
                            min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, outside the top-p nucleus, or below
    min_p x the top probability. logits: [vocab] or [n, vocab] (already temperature-scaled),
    one set of parameters for every row."""
    rows = logits.reshape(-1, logits.shape[-1])  # [n, vocab]
    params = np.tile([1.0, top_k, top_p, min_p, -1.0], (rows.shape[0], 1))  # no draw
    _, threshold = _truncate(rows, params, draw=False)
    return torch.where(rows >= threshold[:, None], rows, NEG_INF).view_as(logits)


def _truncate(x: torch.Tensor, params: np.ndarray,
              draw: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [n, vocab], params [n, 5] (temperature, top_k, top_p, min_p, uniform) ->
    (drawn token ids [n], undefined without draw; kept thresholds [n] of x / temperature):
    the C kernel on CPU logits, its torch reference on x's device otherwise."""
    if cpu_sampler.fits(x) and cpu_sampler.available():
        return cpu_sampler.sample_packed(x, params)
    temperature, top_k, top_p, min_p, uniform = torch.from_numpy(params).unbind(1)
    return cpu_sampler.sample_ref(x, temperature.float(), top_k.long(), top_p, min_p,
                                  uniform if draw else None)


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
    dev = logits.device
    return logits.index_put((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                            torch.tensor(NEG_INF, dtype=logits.dtype, device=dev))


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Repetition penalty (Hugging Face semantics, over prompt and output) and OpenAI
    presence / frequency penalties (over the output only), on the rows that have any."""
    rows = [row for row, req in enumerate(reqs) if req.params.has_penalties]
    if not rows:
        return logits
    params = [reqs[i].params for i in rows]
    vocab = logits.shape[-1]
    x = logits[rows]  # [r, vocab]
    dev = logits.device
    rep = _column([p.repetition_penalty for p in params], dev)  # [r, 1]
    seen = _token_counts([reqs[i].all_token_ids for i in rows], vocab, dev) > 0  # [r, vocab]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = _token_counts([reqs[i].output_token_ids for i in rows], vocab, dev)  # [r, vocab]
    freq = _column([p.frequency_penalty for p in params], dev)
    pres = _column([p.presence_penalty for p in params], dev)
    x = torch.where(counts > 0, x - (freq * counts + pres), x)
    return logits.index_copy(0, torch.tensor(rows, device=dev), x)


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
    dev = logits.device
    return logits.index_put((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                            torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def apply_grammar_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """Tokens a grammar rules out -> -inf, in the mask's rows only (a new tensor)."""
    if mask is None:
        return logits
    rows = torch.tensor(mask.rows, device=logits.device)
    allowed = mask.allowed[:, :logits.shape[-1]].to(logits.device)
    masked = torch.where(allowed, logits[rows], NEG_INF)
    return logits.index_copy(0, rows, masked)


def _token_counts(token_ids: Sequence[list[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """counts[i, t]: occurrences of token t in token_ids[i] (ids >= vocab ignored).
    [len(token_ids), vocab] fp32."""
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)),
                                   torch.tensor([len(ids) for ids in token_ids]))
    keep = flat < vocab
    counts = torch.zeros(len(token_ids), vocab, device=device)
    index = (rows[keep].to(device), flat[keep].to(device))
    return counts.index_put_(index, torch.ones((), device=device), accumulate=True)


# ------------------------------------------------------------------ draws

def _argmax(x: torch.Tensor) -> torch.Tensor:
    """First index of each row's max, as torch.argmax, through chunk maxima (torch's CPU
    argmax over a long row is ~10x slower than amax). x: [n, vocab] -> [n]."""
    n, vocab = x.shape
    if vocab % ARGMAX_CHUNK:
        return torch.argmax(x, dim=-1)
    chunks = x.reshape(n, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)  # [n, C, L]
    first = torch.argmax(chunks.amax(-1), dim=-1)  # [n]: the first chunk holding the max
    inner = torch.argmax(chunks[torch.arange(n, device=x.device), first], dim=-1)  # [n]
    return first * ARGMAX_CHUNK + inner


# ------------------------------------------------------------------ logprobs

class _Packed(NamedTuple):
    """Token ids, and the logprobs asked for, in one flat tensor: int64 ids alone, or fp64
    (which holds every id and fp32 logprob exactly) ids, chosen logprobs, then per distinct
    top-n count its (ids, values)."""
    flat: torch.Tensor
    num_reqs: int
    rows: list[int]  # the rows that ask for logprobs
    groups: list[tuple[int, list[int]]]  # (top-n, positions in rows)


def _pack(token_ids: torch.Tensor, raw: torch.Tensor, reqs: Sequence[Request],
          rows: list[int]) -> _Packed:
    """The step's token ids [len(reqs)] and the logprobs of `rows` under raw logits, on the
    device in one tensor, so that one copy brings them to the host."""
    if not rows:
        return _Packed(token_ids, len(reqs), rows, [])
    logprobs = ops.log_softmax(take_rows(raw, rows))  # [len(rows), vocab]
    mine = token_ids if len(rows) == len(reqs) else \
        token_ids[torch.tensor(rows, device=token_ids.device)]
    parts = [token_ids.double(), logprobs.gather(1, mine[:, None])[:, 0].double()]
    nums = [reqs[row].params.logprobs for row in rows]
    groups = []  # one topk per distinct count, so ties come out as from a one-row topk
    for num in sorted(set(nums) - {0}):
        group = [j for j, n in enumerate(nums) if n == num]
        values, ids = torch.topk(take_rows(logprobs, group), num)  # [len(group), num]
        parts += [ids.double().reshape(-1), values.double().reshape(-1)]
        groups.append((num, group))
    return _Packed(torch.cat(parts), len(reqs), rows, groups)


def _unpack(flat: list, packed: _Packed) -> tuple[list[int], list[TokenLogprob | None]]:
    """(token ids, logprobs: None for the rows that did not ask) of a packed tensor's
    values on the host."""
    num_reqs, rows = packed.num_reqs, packed.rows
    out: list[TokenLogprob | None] = [None] * num_reqs
    if not rows:
        return flat, out
    ids_out = [int(t) for t in flat[:num_reqs]]
    chosen, at = flat[num_reqs:num_reqs + len(rows)], num_reqs + len(rows)
    tops: list[list[tuple[int, float]]] = [[] for _ in rows]
    for num, group in packed.groups:
        size = len(group) * num
        top_ids, top_values = flat[at:at + size], flat[at + size:at + 2 * size]
        for i, j in enumerate(group):
            tops[j] = [(int(t), v) for t, v in
                       zip(top_ids[i * num:(i + 1) * num], top_values[i * num:(i + 1) * num])]
        at += 2 * size
    for j, row in enumerate(rows):
        out[row] = TokenLogprob(ids_out[row], chosen[j], tops[j])
    return ids_out, out


def _read_back(token_ids: torch.Tensor, raw: torch.Tensor, reqs: Sequence[Request],
               rows: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
    """The step's token ids and the logprobs of `rows` (None elsewhere), brought to the
    host in one copy: on a GPU, the sampler's one wait."""
    packed = _pack(token_ids, raw, reqs, rows)
    return _unpack(HostCopy(packed.flat).wait().tolist(), packed)


# ------------------------------------------------------------------ helpers

def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for an ascending row list, without a copy when it is every row."""
    return x if len(rows) == x.shape[0] else x[rows]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

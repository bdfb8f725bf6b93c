"""Sampler semantics on hand-made logits: masks, penalties, seeds, min_tokens, logprobs; and
the batched sampler against the one-row reference it replaced (kept below as `Reference`):
greedy tokens and logprobs bit for bit, masks but where fp32 rounding or tie order decided
the old one, draws in distribution; seeded draws are the float64 reference's for the
position's uniform."""
from __future__ import annotations

import math
import random

import pytest
import torch

from duplex.engine import sampler as sampler_module
from duplex.kernels import cpu_sampler
from duplex.engine.messages import TokenLogprob
from duplex.engine.request import Request
from duplex.engine.sampler import Sampler, apply_top_k_top_p_min_p, seeded_uniform
from duplex.engine.sampling_params import SamplingParams
from duplex.kernels import ops
from duplex.kernels.batch_invariant import set_batch_invariant_mode


def req(params: SamplingParams, prompt=(1, 2), output=(), eos=(0,)) -> Request:
    r = Request("r", list(prompt), params, tuple(eos))
    r.output_token_ids = list(output)
    return r


# ------------------------------------------------------------------ the one-row reference
# engine/sampler.py before batching, verbatim but for names: the spec the batched one meets.

class Reference:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits, reqs):
        raw = logits
        logits = logits.clone()
        for row, r in enumerate(reqs):
            ref_mask_early_stop(logits[row], r)
            if r.params.has_penalties:
                ref_apply_penalties(logits[row], r)
        token_ids = [self.choose(logits[row], r) for row, r in enumerate(reqs)]
        return token_ids, ref_logprobs(raw, reqs, token_ids)

    def choose(self, logits, r) -> int:
        params = r.params
        if params.is_greedy:
            return int(torch.argmax(logits))
        logits = logits / params.temperature
        logits = ref_apply_top_k_top_p_min_p(logits, params.top_k, params.top_p, params.min_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=r.generator or self.generator)
        return int(torch.argmax(probs / noise))


def ref_apply_top_k_top_p_min_p(logits, top_k, top_p, min_p):
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def ref_mask_early_stop(logits, r) -> None:
    if r.num_output_tokens >= r.params.min_tokens:
        return
    banned = list(r.params.stop_token_ids)
    if not r.params.ignore_eos:
        banned += list(r.eos_token_ids)
    if banned:
        logits[torch.tensor(banned)] = float("-inf")


def ref_apply_penalties(logits, r) -> None:
    params = r.params
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if r.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def ref_logprobs(raw, reqs, token_ids):
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    out = [None] * len(reqs)
    if not rows:
        return out
    logprobs = ops.log_softmax(raw[rows])
    for j, row in enumerate(rows):
        num_top = reqs[row].params.logprobs
        top = []
        if num_top:
            values, ids = torch.topk(logprobs[j], num_top)
            top = list(zip(ids.tolist(), values.tolist()))
        token = token_ids[row]
        out[row] = TokenLogprob(token, float(logprobs[j, token]), top)
    return out


def ref_kept(logits_row, r) -> torch.Tensor:
    """The reference's kept tokens [vocab] bool for one request's raw logits row."""
    x = logits_row.clone()
    ref_mask_early_stop(x, r)
    if r.params.has_penalties:
        ref_apply_penalties(x, r)
    p = r.params
    return torch.isfinite(ref_apply_top_k_top_p_min_p(x / p.temperature, p.top_k, p.top_p,
                                                      p.min_p))


# ------------------------------------------------------------------ logits factories

def peaked(num_rows: int, vocab: int, gen: torch.Generator, gap: float = 16.0) -> torch.Tensor:
    """A bulk N(0, 2^2) and a few tokens `gap` above it, like a language model's logits."""
    x = torch.randn(num_rows, vocab, generator=gen) * 2
    heads = torch.randint(0, vocab, (num_rows, 8), generator=gen)
    return x.scatter(1, heads, gap + 2 * torch.randn(num_rows, 8, generator=gen))


def flat(num_rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A nucleus of thousands of tokens: wider than the candidate prefilter."""
    return torch.randn(num_rows, vocab, generator=gen) * 0.5


def tied(num_rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Logits on a coarse grid: many exact ties, as from a low-precision model."""
    return (peaked(num_rows, vocab, gen, gap=8.0) * 2).round() / 2


def kinds(num_rows: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"peaked": peaked(num_rows, vocab, gen), "sharp": peaked(num_rows, vocab, gen, 22.0),
            "flat": flat(num_rows, vocab, gen), "tied": tied(num_rows, vocab, gen)}


def chi_square_pvalue(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    stat = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))
    dof = torch.tensor((len(probs) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2.0, dtype=torch.float64)))


# ------------------------------------------------------------------ masks

def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = apply_top_k_top_p_min_p(logits, 2, 1.0, 0.0)
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two tokens cover top_p
    out = apply_top_k_top_p_min_p(logits, 0, 0.7, 0.0)
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    out = apply_top_k_top_p_min_p(logits, 0, 0.5, 0.0)
    assert torch.isfinite(out).tolist() == [True, False, False, False]
    out = apply_top_k_top_p_min_p(logits, 0, 0.01, 0.0)
    assert torch.isfinite(out).tolist() == [True, False, False, False], "never empty"


def test_min_p_relative_to_top():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    out = apply_top_k_top_p_min_p(logits, 0, 1.0, 0.5)  # keep p >= 0.25
    assert torch.isfinite(out).tolist() == [True, True, False, False]


def new_kept(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The float64-defined kept set (kernels/cpu_sampler.sample_ref) of rows x [n, vocab]."""
    n = x.shape[0]
    _, threshold = cpu_sampler.sample_ref(x, torch.ones(n), torch.full((n,), top_k),
                                          torch.full((n,), top_p, dtype=torch.float64),
                                          torch.full((n,), min_p, dtype=torch.float64), None)
    return x >= threshold[:, None]


@pytest.mark.parametrize("vocab", [64, 8192, 8191])
def test_masks_match_the_float64_reference_and_the_old_one_but_at_rounding(vocab):
    """The kernel's masks are the float64 reference's; against the old fp32 one-row reference
    they differ only in rows whose boundary fp32 rounding or torch.sort's tie order decided,
    and then only by tokens of negligible mass."""
    num_rows = num_differ = 0
    for kind, logits in kinds(4, vocab, seed=vocab).items():
        for top_k in (0, 5, 300, vocab):
            for top_p in (1.0, 0.5, 0.95, 0.999):
                for min_p in (0.0, 0.2):
                    got = torch.isfinite(apply_top_k_top_p_min_p(logits, top_k, top_p, min_p))
                    assert torch.equal(got, new_kept(logits, top_k, top_p, min_p)), \
                        (kind, top_k, top_p, min_p)
                    assert torch.equal(torch.isfinite(apply_top_k_top_p_min_p(
                        logits[1], top_k, top_p, min_p)), got[1])
                    old = torch.stack([torch.isfinite(ref_apply_top_k_top_p_min_p(
                        row, top_k, top_p, min_p)) for row in logits])
                    probs = torch.softmax(logits.double(), -1)
                    if kind != "tied":
                        num_rows += len(logits)
                        num_differ += int((got != old).any(-1).sum())
                    mass = (probs * (got != old)).sum(-1) / (probs * old).sum(-1)
                    if kind == "tied":  # a tied group is kept whole, the old kept a part
                        assert not (old & ~got).any(), (kind, top_k, top_p, min_p)
                    else:
                        assert float(mass.max()) < 1e-4, (kind, top_k, top_p, min_p)
    print(f"rows whose mask differs from the old fp32 reference: {num_differ} / {num_rows}")
    assert num_differ <= 0.02 * num_rows, (num_differ, num_rows)


def test_a_nucleus_of_thousands_of_tokens():
    logits = flat(4, 8192, torch.Generator().manual_seed(1))
    got = torch.isfinite(apply_top_k_top_p_min_p(logits, 0, 0.95, 0.0))
    assert torch.equal(got, new_kept(logits, 0, 0.95, 0.0))
    assert int(got.sum(-1).min()) > 4096


def test_a_tied_group_on_the_top_p_boundary_is_kept_whole():
    logits = torch.full((8192,), -10.0)
    logits[torch.arange(40) * 200] = 0.0  # 40 equally likely tokens hold almost all the mass
    got = torch.isfinite(apply_top_k_top_p_min_p(logits, 0, 0.5, 0.0))
    assert int(got.sum()) == 40 and bool(got[torch.arange(40) * 200].all())
    # the old reference kept the part of the group torch.sort happened to put first
    assert 0 < int(torch.isfinite(ref_apply_top_k_top_p_min_p(logits, 0, 0.5, 0.0)).sum()) < 40


def test_top_p_just_below_one_still_applies():
    logits = peaked(2, 8192, torch.Generator().manual_seed(3))
    top_p = 1.0 - 1e-9  # fp32 1.0; in float64 it drops the tail that holds < 1e-9
    got = torch.isfinite(apply_top_k_top_p_min_p(logits, 0, top_p, 0.0))
    assert torch.equal(got, new_kept(logits, 0, top_p, 0.0))
    assert 0 < int((~got).sum(-1).min())


# ------------------------------------------------------------------ the sampler

def random_request(rng: random.Random, vocab: int, index: int) -> Request:
    greedy = rng.random() < 0.2
    params = SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 40, 300]), top_p=rng.choice([1.0, 0.5, 0.9, 0.95]),
        min_p=rng.choice([0.0, 0.0, 0.05]), seed=rng.choice([None, rng.randrange(2**63)]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        min_tokens=rng.choice([0, 0, 3]), stop_token_ids=rng.sample(range(vocab), 2),
        ignore_eos=rng.random() < 0.3, logprobs=rng.choice([None, None, 0, 3, 20]))
    prompt = [rng.randrange(vocab + 5) for _ in range(rng.randrange(1, 30))]  # some >= vocab
    r = Request(f"r{index}", prompt, params, (rng.randrange(vocab),))
    r.output_token_ids = [rng.randrange(vocab + 5) for _ in range(rng.randrange(0, 6))]
    return r


def expected_draw(logits_row: torch.Tensor, r: Request, uniform: float) -> int:
    """The float64 reference's draw for one request's raw logits row and uniform."""
    x = logits_row.clone()
    ref_mask_early_stop(x, r)
    if r.params.has_penalties:
        ref_apply_penalties(x, r)
    p = r.params
    token, _ = cpu_sampler.sample_ref(
        x[None], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
        torch.tensor([p.top_p], dtype=torch.float64),
        torch.tensor([p.min_p], dtype=torch.float64),
        torch.tensor([uniform], dtype=torch.float64))
    return int(token[0])


@pytest.mark.parametrize("vocab", [64, 8192])
def test_greedy_seeded_and_logprobs_match_the_reference(vocab):
    """Greedy tokens and logprobs bit for bit the old one-row sampler's; a seeded row draws
    the reference's token for its position's uniform; an unseeded one a kept token."""
    rng = random.Random(vocab)
    rows = kinds(8, vocab, seed=vocab + 1)
    logits = torch.cat(list(rows.values()))  # [32, vocab]
    reqs = [random_request(rng, vocab, i) for i in range(len(logits))]
    out = Sampler(7)(logits, reqs)
    expected_ids, _ = Reference(7)(logits, reqs)
    for row, r in enumerate(reqs):
        if r.params.is_greedy:
            assert out.token_ids[row] == expected_ids[row], row
        elif r.params.seed is not None:
            assert out.token_ids[row] == expected_draw(logits[row], r, seeded_uniform(r)), row
        else:
            assert new_kept_row(logits[row], r)[out.token_ids[row]], row
    assert out.logprobs == ref_logprobs(logits, reqs, out.token_ids)
    assert sum(r.params.seed is not None and not r.params.is_greedy for r in reqs) >= 8


def new_kept_row(logits_row: torch.Tensor, r: Request) -> torch.Tensor:
    x = logits_row.clone()
    ref_mask_early_stop(x, r)
    if r.params.has_penalties:
        ref_apply_penalties(x, r)
    p = r.params
    return new_kept((x / p.temperature)[None], p.top_k, p.top_p, p.min_p)[0] & torch.isfinite(x)


def test_a_seeded_token_depends_on_its_seed_and_position_only():
    logits = torch.cat([peaked(4, 8192, torch.Generator().manual_seed(4), gap=22.0),
                        flat(4, 8192, torch.Generator().manual_seed(5))])
    reqs = [req(SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i), output=[5] * i)
            for i in range(8)]
    first = Sampler(0)(logits, reqs).token_ids
    assert first == [expected_draw(logits[i], r, seeded_uniform(r)) for i, r in enumerate(reqs)]
    again = Sampler(99)(logits.flip(0), reqs[::-1]).token_ids  # another order, engine seed
    assert again[::-1] == first
    moved = req(SamplingParams(temperature=0.8, top_p=0.9, seed=100), output=[5] * 3)
    assert seeded_uniform(moved) != seeded_uniform(reqs[0]), "the next position, another uniform"


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    out = Sampler()(logits, [req(SamplingParams(temperature=0, logprobs=2))])
    assert out.token_ids == [1]
    lp = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0].token_id == 1
    assert math.isclose(out.logprobs[0].logprob, float(lp[1]), rel_tol=1e-6)
    assert [t for t, _ in out.logprobs[0].top] == [1, 2]


def test_seed_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    params = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler(0)(logits[1:2], [req(params)]).token_ids[0] for _ in range(1)]
    # same seed inside a batch with other (unseeded) requests, different engine seed
    b = Sampler(7)(logits, [req(SamplingParams(temperature=1.0)), req(params),
                            req(SamplingParams(temperature=0.5))]).token_ids[1]
    assert a[0] == b
    draws = {Sampler(0)(logits[:1], [req(SamplingParams(temperature=1.0, seed=s))]).token_ids[0]
             for s in range(30)}
    assert len(draws) > 5, "different seeds give different draws"


def test_a_row_does_not_depend_on_the_batch_in_batch_invariant_mode():
    rng = random.Random(11)
    logits = torch.cat(list(kinds(4, 8192, seed=12).values()))  # [16, 8192]
    reqs = [random_request(rng, 8192, i) for i in range(16)]
    seeded = [i for i, r in enumerate(reqs) if r.params.is_greedy or r.params.seed is not None]
    with set_batch_invariant_mode():
        together = Sampler(0)(logits, reqs)
        for row in seeded:
            alone = Sampler(0)(logits[row:row + 1], [reqs[row]])
            assert alone.token_ids[0] == together.token_ids[row]
            assert alone.logprobs[0] == together.logprobs[row]


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75]
    sampler = Sampler(0)
    hits = sum(sampler(logits, [req(SamplingParams(temperature=1.0))]).token_ids[0]
               for _ in range(4000))
    assert abs(hits / 4000 - 0.75) < 0.03


@pytest.mark.parametrize("vocab, params", [
    (6, SamplingParams(temperature=0.8, top_p=0.9)),
    (6, SamplingParams(temperature=1.3, top_k=4, min_p=0.05)),
    (8192, SamplingParams(temperature=1.0, top_k=6)),
    (8192, SamplingParams(temperature=1.0, top_p=0.8, min_p=0.002)),
])
def test_unseeded_draws_follow_the_reference_distribution(vocab, params):
    gen = torch.Generator().manual_seed(vocab)
    row = peaked(1, vocab, gen, gap=14.0) if vocab > 6 else torch.randn(1, vocab, generator=gen)
    x = row[0] / params.temperature
    probs = torch.softmax(ref_apply_top_k_top_p_min_p(x, params.top_k, params.top_p,
                                                      params.min_p), -1)
    support = probs.nonzero()[:, 0].tolist()
    assert 2 <= len(support) <= 12
    num_draws = 6000
    token_ids = Sampler(3)(row.expand(num_draws, vocab).contiguous(),
                           [req(params) for _ in range(num_draws)]).token_ids
    assert set(token_ids) <= set(support)
    counts = [token_ids.count(t) for t in support]
    assert chi_square_pvalue(counts, [float(probs[t]) for t in support]) > 1e-3


def test_unseeded_draws_over_the_whole_vocabulary_follow_the_distribution():
    logits = 0.1 * torch.randn(1, 4096, generator=torch.Generator().manual_seed(7))
    logits[0, :4] = torch.tensor([8.0, 7.5, 7.0, 6.0])  # the bulk holds a third of the mass
    params = SamplingParams(temperature=1.0, top_p=0.99)
    probs = torch.softmax(ref_apply_top_k_top_p_min_p(logits[0], 0, 0.99, 0.0), -1)
    token_ids = Sampler(5)(logits.expand(4000, 4096).contiguous(),
                           [req(params) for _ in range(4000)]).token_ids
    assert all(probs[t] > 0 for t in token_ids)
    buckets = [min(t, 4) for t in token_ids]  # the four heads, then the bulk as one bucket
    counts = [buckets.count(b) for b in range(5)]
    expected = probs[:4].tolist() + [float(probs[4:].sum())]
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_the_draw_is_in_proportion_and_never_a_zero_weight():
    weights = torch.zeros(5000)
    support = [3, 700, 701, 2500, 4097, 4999]
    weights[support] = torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0, 1.5])
    n = 6000
    params = SamplingParams(temperature=1.0)
    draws = Sampler(0)(weights.log().expand(n, 5000).contiguous(),
                       [req(params) for _ in range(n)]).token_ids
    assert set(draws) <= set(support)
    probs = (weights[support] / weights.sum()).tolist()
    assert chi_square_pvalue([draws.count(t) for t in support], probs) > 1e-3


def test_argmax_is_the_first_max():
    gen = torch.Generator().manual_seed(0)
    for vocab in (4096, 4095):
        x = torch.randint(0, 5, (50, vocab), generator=gen).float()  # many tied maxima
        assert torch.equal(sampler_module._argmax(x), torch.argmax(x, dim=-1))


def test_inference_logits_are_read_not_written():
    with torch.inference_mode():
        logits = peaked(3, 8192, torch.Generator().manual_seed(6))
    before = logits.clone()
    reqs = [req(SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.2,
                               min_tokens=2, logprobs=2)),
            req(SamplingParams(temperature=0)), req(SamplingParams(top_k=3, seed=1))]
    Sampler(0)(logits, reqs)
    assert torch.equal(logits, before)


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[10.0, 0.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert Sampler()(logits, [req(params, output=[3])]).token_ids == [3]
    assert Sampler()(logits, [req(params, output=[3, 3])]).token_ids == [0]


def test_min_tokens_ignores_stop_ids_outside_the_vocabulary():
    logits = torch.tensor([[10.0, 0.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2, 99])
    assert Sampler()(logits, [req(params, output=[3])]).token_ids == [3]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.9, -1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 was seen: 2.0 -> 1.0, so token 2 (1.9) wins
    assert Sampler()(logits, [req(params, prompt=[0, 1])]).token_ids == [2]


def test_frequency_and_presence_penalties_count_output_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    freq = SamplingParams(temperature=0, frequency_penalty=0.4)
    assert Sampler()(logits, [req(freq, prompt=[0, 0, 0])]).token_ids == [0]
    assert Sampler()(logits, [req(freq, output=[0, 0])]).token_ids == [1]  # 3.0 - 0.8
    pres = SamplingParams(temperature=0, presence_penalty=0.6)
    assert Sampler()(logits, [req(pres, output=[0])]).token_ids == [1]  # 3.0 - 0.6


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-2), dict(min_p=2), dict(max_tokens=0),
                                 dict(logprobs=100), dict(stop=[""]),
                                 dict(presence_penalty=3), dict(repetition_penalty=0),
                                 dict(min_tokens=5, max_tokens=2)])
def test_nonsense_values_are_rejected(bad):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**bad)


def test_the_device_path_reads_the_step_back_in_one_copy(monkeypatch):
    """Tokens and every logprob asked for (two top-n sizes), with penalties, seeds, min_p
    and a mix of greedy and sampled rows: on the device path (the torch reference, as on a
    GPU) one value read back, the same outputs as the C kernel's path."""
    from tests.readbacks import ReadBacks

    reqs = [req(SamplingParams(temperature=0, logprobs=2)),
            req(SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=0)),
            req(SamplingParams(temperature=1.0, top_k=5, min_p=0.1, presence_penalty=0.5,
                               repetition_penalty=1.2, logprobs=2), output=(3, 4)),
            req(SamplingParams(temperature=0.7, logprobs=1)),
            req(SamplingParams(temperature=0))]
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(7))
    want = Sampler(0)(logits, reqs)
    monkeypatch.setattr(cpu_sampler, "available", lambda: False)
    with torch.inference_mode(), ReadBacks(monkeypatch) as reads:
        got = Sampler(0)(logits, reqs)
    assert reads.reads == ["tolist"]
    assert got.token_ids == want.token_ids
    assert [lp is None for lp in got.logprobs] == [False, False, False, False, True]
    for a, b in zip(got.logprobs, want.logprobs):
        assert a == b

"""Sampler semantics on hand-made logits: masks, penalties, seeds, min_tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, apply_top_k_top_p_min_p
from engine.sampling_params import SamplingParams


def req(params: SamplingParams, prompt=(1, 2), output=(), eos=(0,)) -> Request:
    r = Request("r", list(prompt), params, tuple(eos))
    r.output_token_ids = list(output)
    return r


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


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75]
    sampler = Sampler(0)
    hits = sum(sampler(logits, [req(SamplingParams(temperature=1.0))]).token_ids[0]
               for _ in range(4000))
    assert abs(hits / 4000 - 0.75) < 0.03


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[10.0, 0.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert Sampler()(logits, [req(params, output=[3])]).token_ids == [3]
    assert Sampler()(logits, [req(params, output=[3, 3])]).token_ids == [0]


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

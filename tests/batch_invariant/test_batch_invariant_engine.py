"""Invariant 8: with batch_invariant=True a request's tokens and logprobs are bitwise the same
whatever else is in the batch: random companions (1-32 others), random arrival times, prefix
hits, chunked prefill."""
from __future__ import annotations

import random

import pytest

from engine.messages import AddRequest
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core

NUM_TARGETS = 16
NUM_NEW = 64


def _prompts(seed: int, n: int, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = [rng.randrange(200, 20000) for _ in range(rng.randint(4, 60))]
        out.append((shared or []) + body if rng.random() < 0.5 else body)
    return out


def _run(core, jobs: list[tuple[str, list[int], SamplingParams, int]]) -> dict:
    """jobs: (req_id, prompt, params, arrival step). Returns req_id -> (tokens, logprobs)."""
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid, *_ in jobs}
    step, last = 0, max(a for *_, a in jobs)
    while step <= last or core.has_unfinished_requests():
        for rid, prompt, params, arrival in jobs:
            if arrival == step:
                core.add_request(AddRequest(rid, prompt, params))
        for d in core.step():
            out[d.req_id][0].extend(d.new_token_ids)
            out[d.req_id][1].extend(lp.logprob for lp in d.logprobs)
        step += 1
    return out


def _experiment(model: str, batch_invariant: bool, seed: int = 0) -> tuple[int, int]:
    """(number of targets whose batched run differs from solo, number of targets)."""
    shared = _prompts(99, 1)[0] * 2  # a prefix some prompts share: prefix-cache hits
    targets = _prompts(seed, NUM_TARGETS, shared)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=1000 + i,
                             max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
              for i in range(NUM_TARGETS)]
    solo_core = make_core(model, batch_invariant=batch_invariant, enable_prefix_caching=False)
    solo = {}
    for i, (p, sp) in enumerate(zip(targets, params)):
        solo[f"t{i}"] = _run(solo_core, [(f"t{i}", p, sp, 0)])[f"t{i}"]
    rng = random.Random(seed + 1)
    busy_core = make_core(model, batch_invariant=batch_invariant, max_num_batched_tokens=48,
                          max_num_seqs=40)
    differing = 0
    for rnd in range(2):  # the second round hits the prefix cache the first one filled
        jobs = []
        for i, (p, sp) in enumerate(zip(targets, params)):
            jobs.append((f"t{i}", p, sp, rng.randint(0, 12)))
        companions = _prompts(seed + 10 + rnd, rng.randint(1, 32), shared)
        for j, p in enumerate(companions):
            jobs.append((f"c{rnd}-{j}", p, SamplingParams(
                temperature=0.7, max_tokens=rng.randint(1, 40), ignore_eos=True),
                rng.randint(0, 20)))
        got = _run(busy_core, jobs)
        differing += sum(got[f"t{i}"] != solo[f"t{i}"] for i in range(NUM_TARGETS))
        for i in range(NUM_TARGETS):
            if batch_invariant:
                assert got[f"t{i}"][0] == solo[f"t{i}"][0], f"round {rnd}: target {i} tokens"
                assert got[f"t{i}"][1] == solo[f"t{i}"][1], f"round {rnd}: target {i} logprobs"
    return differing, 2 * NUM_TARGETS


@pytest.mark.slow
def test_batch_invariant_mode_is_bitwise_independent_of_the_batch(default_model):
    differing, total = _experiment(default_model, batch_invariant=True)
    assert differing == 0 and total == 2 * NUM_TARGETS

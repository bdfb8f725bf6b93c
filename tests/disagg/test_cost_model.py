"""duplex.engine.cost_model and engine.step_policy: the fit converges on synthetic step times, chunk
sizes respect the time budget, and a running long prompt leaves room for a short one."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from duplex.engine.cost_model import CostModel, StepFeatures, attended_pairs
from duplex.engine.request import Request
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.step_policy import MIN_CHUNK, time_budget

from .conftest import engine_config, request

TRUE = (2e-4, 3e-3, 1e-3, 5e-3)  # s per prefill token, per 1k attended pairs, per seq, step


def true_seconds(f: StepFeatures) -> float:
    return sum(c * x for c, x in zip(TRUE, f.vector()))


def random_features(rng: random.Random) -> StepFeatures:
    num_decode = rng.randint(0, 32)
    prefill = rng.choice([0, rng.randint(1, 512)])
    offset = rng.randint(0, 2000)
    ktokens = (attended_pairs(offset, prefill) + num_decode * rng.randint(10, 2000)) / 1000
    return StepFeatures(prefill, ktokens, num_decode)


def fitted_model(noise: float = 0.02, num_steps: int = 300) -> CostModel:
    rng = random.Random(0)
    model = CostModel()
    for _ in range(num_steps):
        f = random_features(rng)
        model.observe(f, true_seconds(f) * (1 + rng.uniform(-noise, noise)))
    return model


def test_fit_converges_to_the_true_coefficients():
    model = fitted_model()
    for got, want in zip(model.coef, TRUE):
        assert got == pytest.approx(want, rel=0.1)
    assert model.median_rel_error < 0.02
    stats = model.stats()
    assert stats.prefill_token_s == pytest.approx(TRUE[0], rel=0.1)
    assert stats.num_samples == 300
    assert CostModel.from_dict(model.to_dict()).coef.tolist() == model.coef.tolist()
    figures = stats.figures("cost_")  # the names /metrics exports
    assert CostModel.from_dict(figures).coef.tolist() == model.coef.tolist()


def test_coefficients_stay_non_negative_and_unseen_features_abstain():
    model = CostModel()
    assert model.predict(StepFeatures(10, 1.0, 1)) is None
    for n in range(1, 40):  # decode only: no prefill token is ever seen
        model.observe(StepFeatures(0, n * 0.5, n), 0.004 + 0.001 * n)
    assert (model.coef >= 0).all() and model.coef[0] == 0
    assert model.max_prefill_tokens(0.1, limit=512) is None or model.coef[1] > 0


def _computed(req: Request, num_computed: int) -> Request:
    req.advance(num_computed)
    return req


def test_chunk_sizing_respects_the_budget():
    model = fitted_model(noise=0.0)
    running = [_computed(Request(f"r{i}", list(range(300)), SamplingParams()), 299)
               for i in range(8)]
    prompt = _computed(Request("p", list(range(4096)), SamplingParams()), 1024)
    scheduler = SimpleNamespace(running=[prompt, *running], max_num_batched_tokens=2048)
    for budget_s in (0.02, 0.05, 0.2):
        tokens = time_budget(model, budget_s)(scheduler) - len(running)
        decode_ktokens = len(running) * attended_pairs(299, 1) / 1000

        def cost(n: int) -> float:
            return true_seconds(StepFeatures(
                n, decode_ktokens + attended_pairs(1024, n) / 1000, len(running)))

        if tokens > MIN_CHUNK:
            assert cost(tokens) <= budget_s * 1.001 < cost(tokens + 1)
        else:
            assert cost(MIN_CHUNK) > budget_s * 0.999
    unfitted = time_budget(CostModel(), 0.05)(scheduler)
    assert unfitted == scheduler.max_num_batched_tokens


class _Fixed(CostModel):
    """A fitted cost model that ignores the steps it is shown."""

    def observe(self, features: StepFeatures, seconds: float) -> None:
        pass


def test_engine_reports_its_cost_model_and_chunks_to_the_budget():
    from duplex.engine.core import EngineCore

    core = EngineCore(engine_config(max_num_batched_tokens=128, step_budget_ms=20),
                      progress=False)
    core.add_request(request("warm", list(range(1, 60))))
    while core.has_unfinished_requests():
        core.step()
    cost = core.stats().cost
    assert cost.num_samples >= 8 and cost.step_s >= 0
    assert cost.median_rel_error >= 0
    # the tiny model's step times are noise on a shared box: size chunks with a model of
    # known coefficients that learns nothing more, and check what the scheduler does with it
    model = _Fixed(coef=fitted_model(noise=0.0).coef)
    core = EngineCore(engine_config(max_num_batched_tokens=128, step_budget_ms=20),
                      progress=False, cost_model=model)
    allowed = model.max_prefill_tokens(0.02, limit=128)
    assert MIN_CHUNK < allowed < 128
    core.add_request(request("chunked", list(range(3, 203))))
    sizes = []
    while "chunked" in core.requests and core.requests["chunked"].num_output_tokens == 0:
        before = core.requests["chunked"].num_computed_tokens
        core.step()
        if "chunked" in core.requests:
            sizes.append(core.requests["chunked"].num_computed_tokens - before)
    assert len(sizes) >= 3 and max(sizes) <= allowed


def test_a_short_prompt_gets_its_first_token_during_a_long_prefill():
    from duplex.engine.core import EngineCore

    def first_token_steps(fair: bool) -> dict[str, int]:
        core = EngineCore(engine_config(max_num_batched_tokens=32, fair_prefill=fair),
                          progress=False)
        core.add_request(request("long", [(5 * i) % 300 + 1 for i in range(240)]))
        first: dict[str, int] = {}
        for step in range(40):
            if step == 2:
                core.add_request(request("short", [7, 8, 9, 10, 11]))
            for delta in core.step():
                if delta.new_token_ids:
                    first.setdefault(delta.req_id, step)
            if len(first) == 2:
                return first
        raise AssertionError(f"not done: {first}")

    fair, fifo = first_token_steps(True), first_token_steps(False)
    assert fair["short"] <= 3 < fair["long"]
    assert fifo["short"] >= fifo["long"]  # without the share it waits for the whole prompt


def test_a_batch_that_hardly_varies_is_explained_by_the_step_constant():
    rng = random.Random(1)
    model = CostModel()
    for _ in range(200):  # decode only, 1 or 2 sequences: constant and per-seq are collinear
        num_decode = rng.choice([1, 2])
        f = StepFeatures(0, num_decode * 0.3, num_decode)
        model.observe(f, (0.2 + 0.01 * num_decode) * (1 + rng.uniform(-0.05, 0.05)))
    assert model.coef[3] > 0.15  # most of the 0.2 s per step, not a big per-sequence cost
    assert model.predict(StepFeatures(0, 3.0, 10)) < 0.5

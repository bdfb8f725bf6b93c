"""The per-request pipeline on its own: detokenize, stop strings, n fan-out, failures."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from frontend_fakes import FakeEngineClient, FakeRecipe

from duplex.engine.messages import RequestDelta
from duplex.engine.sampling_params import SamplingParams
from duplex.frontend.errors import ApiError
from duplex.frontend.generation import (Delta, Final, Job, Pipeline, collect, resolve_max_tokens,
                                 sampling_params, total_usage)
from duplex.frontend.metrics import Metrics


def pipeline(engine=None, **kw) -> Pipeline:
    return Pipeline(engine or FakeEngineClient(), FakeRecipe(), Metrics(), **kw)


def job(n=1, req_id="r", **params) -> Job:
    return Job(req_id, [11, 12, 13], SamplingParams(**{"max_tokens": 100, **params}), n=n)


async def run_all(p: Pipeline, jobs) -> list:
    async with contextlib.aclosing(p.run(jobs)) as events:
        return [event async for event in events]


async def test_multibyte_text_split_across_tokens_is_exact():
    text = "héllo 😀 wörld"
    events = await run_all(pipeline(FakeEngineClient(reply=text)), job())
    assert "".join(e.text for e in events if isinstance(e, Delta)) == text
    assert all("\ufffd" not in e.text for e in events if isinstance(e, Delta))
    assert events[-1].finish_reason == "stop"


@pytest.mark.parametrize("stop, include, expected, sequence", [
    (["there"], False, "Hello ", "there"),
    (["there"], True, "Hello there", "there"),
    (["!", "o t"], False, "Hell", "o t"),
    (["zzz"], False, "Hello there, friend!", None),
])
async def test_stop_strings(stop, include, expected, sequence):
    engine = FakeEngineClient()
    events = await run_all(pipeline(engine),
                           job(stop=stop, include_stop_str_in_output=include))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == expected
    final = events[-1]
    assert final.finish_reason == "stop" and final.stop_sequence == sequence
    assert engine.aborted == ([] if sequence is None else ["r"])


async def test_n_choices_each_end_with_one_final():
    engine = FakeEngineClient(step_s=0.001)
    events = await run_all(pipeline(engine), job(n=3, seed=5))
    finals = [e for e in events if isinstance(e, Final)]
    assert sorted(f.index for f in finals) == [0, 1, 2]
    assert sorted(m.req_id for m in engine.added) == ["r-0", "r-1", "r-2"]
    assert sorted(m.params.seed for m in engine.added) == [5, 6, 7]
    for index in range(3):
        assert events.index(next(f for f in finals if f.index == index)) > max(
            i for i, e in enumerate(events) if e.index == index and isinstance(e, Delta))


async def test_many_jobs_number_choices_across_jobs():
    events = await run_all(pipeline(), [job(n=2, req_id="a"), job(n=2, req_id="b")])
    finals = sorted((e for e in events if isinstance(e, Final)), key=lambda f: f.index)
    assert [f.index for f in finals] == [0, 1, 2, 3]
    usage = total_usage(finals, n=2)
    assert usage.prompt_tokens == 6 and usage.completion_tokens == 4 * len("Hello there, friend!")


async def test_closing_early_aborts_every_child():
    engine = FakeEngineClient(step_s=0.01)
    async with contextlib.aclosing(pipeline(engine).run(job(n=4))) as events:
        await anext(events)
    await asyncio.sleep(0)
    assert sorted(engine.aborted) == ["r-0", "r-1", "r-2", "r-3"]
    assert not engine.active


class BrokenEngine(FakeEngineClient):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    async def generate(self, msg):
        yield RequestDelta(msg.req_id, [80])
        if self.mode == "raise":
            raise RuntimeError("socket exploded")


@pytest.mark.parametrize("mode, message", [("raise", "engine error: socket exploded"),
                                           ("end", "the engine stream ended without a result")])
async def test_engine_failures_become_one_error_final(mode, message):
    events = await run_all(pipeline(BrokenEngine(mode)), job())
    assert isinstance(events[-1], Final) and events[-1].finish_reason == "error"
    assert events[-1].error == message and events[-1].failed
    assert events[-1].api_error().kind == "unavailable"


async def test_worker_abort_after_deadline_is_a_timeout():
    engine = FakeEngineClient(step_s=0.03)
    events = await run_all(pipeline(engine, request_timeout_s=0.05), job())
    final = events[-1]
    assert final.finish_reason == "timeout" and final.api_error().kind == "timeout"


async def test_collect_assembles_choices():
    results = await collect(pipeline().run(job(n=2, max_tokens=5)), 2)
    assert [(r.index, r.text, r.final.finish_reason) for r in results] == [
        (0, "Hello", "length"), (1, "Hello", "length")]
    assert results[0].final.usage.completion_tokens == 5
    assert results[0].final.timings.e2e_s >= results[0].final.timings.ttft_s > 0


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 10, 100) == 90
    assert resolve_max_tokens(None, 10, 100, default=16) == 16
    assert resolve_max_tokens(None, 95, 100, default=16) == 5
    assert resolve_max_tokens(90, 10, 100) == 90
    for requested, prompt in ((91, 10), (0, 10), (-3, 10), (None, 100), (None, 0)):
        with pytest.raises(ApiError):
            resolve_max_tokens(requested, prompt, 100)


def test_sampling_params_errors_name_the_field():
    assert sampling_params(stop="x", temperature=None).stop == ["x"]
    with pytest.raises(ApiError) as info:
        sampling_params(top_p=2.0)
    assert info.value.param == "top_p" and info.value.kind == "invalid_request"


class _BurstEngine(FakeEngineClient):
    """Replies in the given bursts of tokens, `gap_s` apart (drafts arrive several at once)."""

    def __init__(self, bursts: list[int], gap_s: float) -> None:
        super().__init__(reply="abcdefghij")
        self.bursts, self.gap_s = bursts, gap_s

    async def _deltas(self, msg):
        ids = self.reply_ids(msg)
        for k, size in enumerate(self.bursts):
            if k:
                await asyncio.sleep(self.gap_s)
            taken, ids = ids[:size], ids[size:]
            last = k == len(self.bursts) - 1
            yield RequestDelta(msg.req_id, taken, finish_reason="length" if last else None,
                               num_prompt_tokens=3)


@pytest.mark.parametrize("bursts, low, high", [
    ([5], 0.0, 0.0),              # all at once: no decode time, no rate (not infinity)
    ([3, 2], 2 / 0.5, 2 / 0.04),  # 2 tokens after the first burst, ~0.05 s later
])
async def test_decode_rate_counts_tokens_after_the_first_delta(bursts, low, high):
    events = await run_all(pipeline(_BurstEngine(bursts, gap_s=0.05)), job())
    rate = events[-1].timings.tokens_per_s
    assert low <= rate <= high

"""The worker checks every AddRequest field itself: a bad one gets one error delta marked
invalid (the frontend answers 400, not a retryable 503) and the worker keeps serving."""
from __future__ import annotations

import math

from duplex.engine.messages import INVALID, AddRequest
from duplex.engine.request_checks import MAX_STOP_TOKEN_IDS, check_add_request
from duplex.engine.sampling_params import SamplingParams

from .conftest import add_request, tokens
from .fake_core import FakeCore
from .test_worker import by_request, start_worker  # noqa: F401 - the fixture


class SmallVocabCore(FakeCore):
    vocab_size = 1000


def test_each_field_is_checked_against_the_vocabulary_and_bounds():
    core = SmallVocabCore.__new__(SmallVocabCore)
    good = add_request("r", [1, 2])
    assert check_add_request(good, core) is None
    cases = {
        "prompt_token_ids": add_request("r", [1, 1000]),
        "output_token_ids": add_request("r", [1], output_token_ids=[5, 4000]),
        "stop_token_ids": AddRequest("r", [1], SamplingParams(stop_token_ids=[10**6],
                                                              min_tokens=2)),
        "req_id": add_request("x" * 300, [1]),
        "deadline": add_request("r", [1], deadline=math.inf),
        f"at most {MAX_STOP_TOKEN_IDS}": AddRequest("r", [1], SamplingParams(
            stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))),
    }
    for needle, msg in cases.items():
        error = check_add_request(msg, core)
        assert error is not None and needle in error, (needle, error)


async def test_out_of_vocabulary_stop_token_gets_an_error_delta_not_a_crash(start_worker,
                                                                           raw_frontend):
    harness = await start_worker(core_factory=SmallVocabCore)
    bad = AddRequest("bad", [1, 2], SamplingParams(max_tokens=4, min_tokens=2,
                                                   stop_token_ids=[10**6]))
    await raw_frontend.send(bad)
    await raw_frontend.send(add_request("good", [1], max_tokens=2))
    grouped = by_request(await raw_frontend.deltas_until_finished({"bad", "good"}))
    (delta,) = grouped["bad"]
    assert (delta.finish_reason, delta.error_kind) == ("error", INVALID)
    assert "stop_token_ids outside the vocabulary [0, 1000)" in delta.error
    assert tokens(grouped["good"]) == [2, 3]
    assert not harness.task.done()

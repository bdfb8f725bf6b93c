"""Invariant 8: with batch_invariant=True a request's tokens and logprobs are bitwise the same
whatever else is in the batch: random companions (1-32 others), random arrival times, prefix
hits, chunked prefill. (The default mode's count of differing runs is reported by
`duplex bench invariance`, not asserted.)"""
from __future__ import annotations

import pytest

from bench.invariance import NUM_TARGETS, experiment
from tests.engine.conftest import make_core


@pytest.mark.slow
def test_batch_invariant_mode_is_bitwise_independent_of_the_batch(default_model):
    result = experiment(lambda **kw: make_core(default_model, **kw), batch_invariant=True)
    assert result["runs"] == 2 * NUM_TARGETS
    for busy in result["busy"]:
        for req_id, (tokens, logprobs) in result["solo"].items():
            assert len(tokens) == 64
            assert busy[req_id][0] == tokens, f"{req_id}: tokens depend on the batch"
            assert busy[req_id][1] == logprobs, f"{req_id}: logprobs depend on the batch"
    assert result["differing_tokens_or_logprobs"] == 0

"""Invariant 8: with batch_invariant=True a request's tokens and logprobs are bitwise the same
whatever else is in the batch: random companions (1-8 others here, up to 32 in the bench),
random arrival times, prefix hits, chunked prefill. (The default mode's count of differing
runs is reported by `duplex bench invariance`, not asserted.)"""
from __future__ import annotations

import pytest

from duplex.bench.invariance import experiment
from tests.engine.conftest import make_core


@pytest.mark.slow
def test_batch_invariant_mode_is_bitwise_independent_of_the_batch(smollm2_shaped):
    # a smaller draw than `duplex bench invariance` (16 targets x 64 tokens, up to 32
    # companions, on the default model), which took ~4 min here: the same property, checked
    # on 4 x 24 at the default model's layer shapes (tests/batch_invariant/conftest.py)
    result = experiment(lambda **kw: make_core(smollm2_shaped, **kw), batch_invariant=True,
                        num_targets=4, num_new=24, max_companions=8)
    assert result["runs"] == 2 * 4
    for busy in result["busy"]:
        for req_id, (tokens, logprobs) in result["solo"].items():
            assert len(tokens) == 24
            assert busy[req_id][0] == tokens, f"{req_id}: tokens depend on the batch"
            assert busy[req_id][1] == logprobs, f"{req_id}: logprobs depend on the batch"
    assert result["differing_tokens_or_logprobs"] == 0

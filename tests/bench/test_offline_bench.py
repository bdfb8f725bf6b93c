"""duplex.bench.offline's decode-step profile on a tiny model: the sampler's share is timed through
the engine's launch-then-read draws, with overlapped scheduling on and off."""
from __future__ import annotations

import pytest

from duplex.bench.offline import decode_step_seconds
from duplex.engine.llm import LLM
from tests.engine.test_tiny_models import build_tiny


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_the_step_profile_times_every_steps_draws(tmp_path_factory, overlap):
    path = build_tiny(tmp_path_factory, "llama")
    llm = LLM(path, weights_dtype="float32", overlap=overlap, progress=False, tokenizer=False)
    step_s, sampler_s, times, _ = decode_step_seconds(llm, 3, 8, steps=4)
    assert len(times) == 4 and 0 < sampler_s < step_s
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()

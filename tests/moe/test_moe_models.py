"""Greedy equality with transformers for tiny random Mixtral, Qwen3-MoE, Qwen2-MoE and
DeepSeek-V3 (MLA, grouped bias-corrected routing, shared experts, dense first layer; default
and YaRN rope) checkpoints, at batch 1, in mixed batches and with chunked prefill."""
from __future__ import annotations

import pytest
import torch

from duplex.engine.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy, hf_model, make_core, run_engine
from tests.moe.conftest import VOCAB

NUM_NEW = 16


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3",
                                  "deepseek_v3_yarn"])
def test_greedy_matches_transformers(tiny_moe, name):
    path = tiny_moe(name)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 40, 3)]
    reference = [hf_greedy(hf_model(path), p, NUM_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    for kwargs in (dict(), dict(max_num_batched_tokens=8, block_size=8)):
        core = make_core(path, **kwargs)
        results = run_engine(core, prompts, params, arrivals=[0, 0, 2, 3])
        solo = run_engine(core, [prompts[1]], params)["r0"]
        assert solo[0] == reference[1][0]
        for i, (tokens, logprobs) in enumerate(reference):
            got_tokens, got_logprobs = results[f"r{i}"]
            assert got_tokens == tokens, f"{name} prompt {i} ({kwargs}): tokens differ"
            torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs),
                                       atol=1e-3, rtol=0)

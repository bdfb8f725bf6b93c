"""Greedy equality with transformers for tiny randomly initialised Qwen2, Qwen3 and Llama
models that the test builds from a config and saves as safetensors (HF directory path)."""
from __future__ import annotations

import pytest
import torch

from duplex.engine.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy, hf_model, make_core, run_engine

NUM_NEW = 24


def build_tiny(tmp_path_factory, arch: str) -> str:
    import transformers

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3, tie_word_embeddings=False)
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    extra = dict(head_dim=32) if arch == "qwen3" else {}  # Qwen3 decouples head_dim
    torch.manual_seed(0)
    model = model_cls(config_cls(**common, **extra)).eval()
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_model_greedy_matches_transformers(tmp_path_factory, arch):
    path = build_tiny(tmp_path_factory, arch)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 29)]
    reference = [hf_greedy(hf_model(path), p, NUM_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    for kwargs in (dict(), dict(max_num_batched_tokens=8, block_size=8)):
        core = make_core(path, **kwargs)
        results = run_engine(core, prompts, params, arrivals=[0, 0, 2, 3, 3])
        solo = run_engine(core, [prompts[1]], params)["r0"]
        assert solo[0] == reference[1][0]
        for i, (tokens, logprobs) in enumerate(reference):
            got_tokens, got_logprobs = results[f"r{i}"]
            assert got_tokens == tokens, f"{arch} prompt {i} ({kwargs}): tokens differ"
            torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs),
                                       atol=1e-3, rtol=0)

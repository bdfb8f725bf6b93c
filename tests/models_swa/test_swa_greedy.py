"""Greedy equality with transformers for tiny random models with sliding-window attention:
Mistral (every layer windowed), Qwen2 / Qwen3 (layers from max_window_layers on), Gemma 3
(local and global layers interleaved, each with its own rope; its attn_logit_softcapping is
set to check that it stays ignored, as in transformers). Prompts plus generation run well past the
window, in mixed batches with staggered arrivals, at batch 1 and with chunked prefill."""
from __future__ import annotations

import functools

import pytest
import torch

from duplex.engine.models.loader import SLIDING
from duplex.engine.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy, make_core, run_engine

WINDOW = 8
NUM_NEW = 24
VOCAB = 384
PROMPT_LENS = (5, 17, 40, 3, 29)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
              tie_word_embeddings=False)


def _configs():
    import transformers as tf

    return {
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(
            **COMMON, num_hidden_layers=2, sliding_window=WINDOW)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(
            **COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=1)),
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config(
            **COMMON, num_hidden_layers=3, head_dim=32, use_sliding_window=True,
            sliding_window=WINDOW, max_window_layers=2)),
        "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **COMMON, num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
            layer_types=[SLIDING, SLIDING, "full_attention", SLIDING],
            query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
            rope_theta=5000.0, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0})),
        "gemma3_plain": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=3, head_dim=16,
            sliding_window=WINDOW, sliding_window_pattern=2)),
    }


@functools.lru_cache(maxsize=None)
def build_tiny(name: str, root: str) -> str:
    """Save a tiny random model; returns its directory."""
    model_cls, config = _configs()[name]
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # Gemma's norms start at 0, i.e. (1 + 0): give them a real weight
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.normal_(0.0, 0.3)
    path = f"{root}/{name}"
    model.save_pretrained(path, safe_serialization=True)
    return path


@functools.lru_cache(maxsize=None)
def hf_reference(path: str) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    # eager: the reference semantics (sdpa refuses attention soft-capping)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return [hf_greedy(model, p, NUM_NEW) for p in prompts()]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    # tiny matmuls: one thread is several times faster than two on a shared box
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield str(tmp_path_factory.mktemp("swa"))
    torch.set_num_threads(threads)


def assert_matches(got, reference, what: str) -> None:
    tokens, logprobs = reference
    assert got[0] == tokens, f"{what}: tokens differ"
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(logprobs), atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "gemma3", "gemma3_plain"])
def test_sliding_window_greedy_matches_transformers(model_root, name):
    path = build_tiny(name, model_root)
    reference = hf_reference(path)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    # the solo prompt (40 tokens + 24 generated) crosses the window many times over
    for kwargs in (dict(block_size=8), dict(block_size=8, max_num_batched_tokens=12)):
        core = make_core(path, num_kv_blocks=64, **kwargs)
        assert any(w == WINDOW for w in core.model.layer_windows)
        solo = run_engine(core, [prompts()[2]], params)["r0"]
        assert_matches(solo, reference[2], f"{name} batch 1 ({kwargs})")
        mixed = run_engine(core, prompts(), params, arrivals=[0, 0, 2, 3, 7])
        for i, ref in enumerate(reference):
            assert_matches(mixed[f"r{i}"], ref, f"{name} prompt {i} mixed ({kwargs})")

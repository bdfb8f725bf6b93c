"""A GGUF file of every architecture Duplex runs gives transformers' greedy tokens on the
same weights: tiny random models written by transformers, converted to GGUF the way
llama.cpp lays them out (tests/models_gguf/conftest.py), in F32, F16, Q8_0 and Q4_0."""
from __future__ import annotations

import functools

import pytest
import torch

from duplex.engine.config import default_model_path
from duplex.engine.models import loader
from duplex.engine.sampling_params import SamplingParams

from tests.engine.conftest import hf_greedy, make_core, run_engine

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11], [300, 2, 64, 128, 33, 8, 9, 10, 200, 150, 77]]
NUM_NEW = 8


@functools.lru_cache(maxsize=4)
def reference(hf_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, NUM_NEW)[0] for p in PROMPTS]


def duplex_greedy(path: str) -> list[list[int]]:
    core = make_core(path, weights_dtype="float32")
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    out = run_engine(core, PROMPTS, params)
    return [out[f"r{i}"][0] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", "mixtral",
                                  "qwen2_moe", "qwen3_moe"])
def test_f32_gguf_greedy_equals_transformers(tiny_model, name):
    model = tiny_model(name)
    assert duplex_greedy(model.gguf("F32")) == reference(str(model.hf_dir))


@pytest.mark.parametrize("name, qtype", [("llama", "Q8_0"), ("mixtral", "Q4_0"),
                                         ("qwen2_moe", "F16")])
def test_quantized_gguf_greedy_equals_transformers_on_its_weights(tiny_model, name, qtype):
    model = tiny_model(name)
    assert duplex_greedy(model.gguf(qtype)) == reference(str(model.reference_dir(qtype)))


@pytest.mark.parametrize("name, arch", [("gemma3", "gemma3_text"), ("mixtral", "mixtral"),
                                        ("qwen3_moe", "qwen3_moe")])
def test_gguf_metadata_gives_the_configs_args(tiny_model, name, arch):
    """The GGUF path and the config.json path build the same ModelArgs (rope scaling and
    the vocabulary ids aside, which a GGUF file carries differently)."""
    model = tiny_model(name)
    from_gguf = loader.load(model.gguf("F32"), progress=False).args
    from_hf = loader.load(str(model.hf_dir), progress=False).args
    assert from_gguf.arch == arch
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "layer_types", "sliding_window", "moe", "qk_norm", "attention_bias",
              "tie_word_embeddings", "query_pre_attn_scalar", "rope_local_theta", "rope_theta")
    assert {f: getattr(from_gguf, f) for f in fields} == {f: getattr(from_hf, f) for f in fields}


def test_tokenizer_and_chat_template_come_from_the_file(tiny_model):
    from duplex.engine.text.tokenizer import load_tokenizer

    path = tiny_model("qwen3_moe").gguf("F32", tokenizer_from=default_model_path(), tag="-tok")
    ours, default = load_tokenizer(path), load_tokenizer(default_model_path())
    text = "Hello, GGUF world!"
    assert ours.encode(text) == default.encode(text)
    assert ours.chat_template == default.chat_template is not None

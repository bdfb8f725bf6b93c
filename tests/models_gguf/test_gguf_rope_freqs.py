"""Llama 3.1 / 3.2 GGUF files ("llama3" rope): llama.cpp writes no rope.scaling keys for them
but a tensor rope_freqs.weight, one divisor per rotary pair; Duplex divides the rotary
frequencies by it and so gives transformers' logits past the original context."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from duplex.engine.models import loader
from duplex.engine.models.args import ModelLoadError

from tests.models_gguf.conftest import (
    LLAMA3_ROPE, duplex_logits, gguf_tensors, hf_logits, llama3_rope_freqs)

NUM_TOKENS = 200  # past original_max_position_embeddings (64)
ATOL = 1e-3


def prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(3, 384, NUM_TOKENS)]


def llama3_file(model, tag: str = "", freqs: np.ndarray | None = None) -> str:
    """The tiny llama3-rope model as llama.cpp writes it (rope_freqs.weight included unless
    `freqs` is given as an empty array: the file without it)."""
    tensors = gguf_tensors(model.state, model.config, model.arch)
    freqs = llama3_rope_freqs(model.config) if freqs is None else freqs
    if freqs.size:
        tensors["rope_freqs.weight"] = freqs
    return model.gguf("F32", tensors=tensors, tag=tag)


def test_rope_freqs_are_the_llama3_divisors(tiny_model):
    """The test's converter formula covers the three bands (1, smoothed, factor) here."""
    freqs = llama3_rope_freqs(tiny_model("llama3_rope").config)
    assert freqs[0] == 1.0 and freqs[-1] == LLAMA3_ROPE["factor"]
    assert any(1.0 < f < LLAMA3_ROPE["factor"] for f in freqs)


def test_llama3_rope_gguf_logits_equal_transformers_past_the_original_context(tiny_model):
    model = tiny_model("llama3_rope")
    ids = prompt()
    expected = hf_logits(model.hf_dir, ids)
    ours = duplex_logits(llama3_file(model), ids)
    assert torch.allclose(ours, expected, atol=ATOL, rtol=0), \
        float((ours - expected).abs().max())
    assert (ours[64:].argmax(-1) == expected[64:].argmax(-1)).all()
    args = loader.check(llama3_file(model))
    assert args.rope_scaling["freq_factors"] == tuple(llama3_rope_freqs(model.config).tolist())


def test_ignoring_rope_freqs_would_not_match(tiny_model):
    """The same weights without the tensor (plain rope) are far from transformers' logits
    past the original context: the comparison above sees the factors."""
    model = tiny_model("llama3_rope")
    ids = prompt()
    expected = hf_logits(model.hf_dir, ids)
    plain = duplex_logits(llama3_file(model, "-plain", np.zeros(0, np.float32)), ids)
    assert float((plain[64:] - expected[64:]).abs().max()) > 100 * ATOL


@pytest.mark.parametrize("kind", ["length", "arch"])
def test_unusable_rope_freqs_is_one_load_error(tiny_model, kind):
    if kind == "length":
        model = tiny_model("llama3_rope")
        path = llama3_file(model, "-short", np.ones(3, np.float32))
        reason = "tensor rope_freqs.weight must hold 8 positive finite factors (one per " \
                 "rotary pair); it holds 3 values, from 1.0 to 1.0"
    else:
        model = tiny_model("qwen2")
        tensors = gguf_tensors(model.state, model.config, model.arch)
        tensors["rope_freqs.weight"] = np.ones(8, np.float32)
        path = model.gguf("F32", tensors=tensors, tag="-rope-freqs")
        reason = "tensor rope_freqs.weight (per-pair rope factors) is supported for llama, " \
                 "mistral, not qwen2"
    with pytest.raises(ModelLoadError) as error:
        loader.check(path)
    assert str(error.value) == f"{path}: {reason}"


def test_quantized_llama3_rope_gguf_greedy_equals_transformers_on_its_weights(tiny_model):
    """Through the engine (prefill, then decode steps): greedy tokens from position 150 on,
    past the original context (without rope_freqs they part at the third token)."""
    from transformers import AutoModelForCausalLM

    from duplex.engine.sampling_params import SamplingParams
    from tests.engine.conftest import hf_greedy, make_core, run_engine

    model = tiny_model("llama3_rope")
    tensors = gguf_tensors(model.state, model.config, model.arch)
    tensors["rope_freqs.weight"] = llama3_rope_freqs(model.config)
    path = model.gguf("Q8_0", tensors=tensors)
    ids = prompt()[:150]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = run_engine(make_core(path, weights_dtype="float32"), [ids], params)["r0"][0]
    reference = AutoModelForCausalLM.from_pretrained(model.reference_dir("Q8_0"),
                                                     dtype=torch.float32).eval()
    assert ours == hf_greedy(reference, ids, 8)[0]

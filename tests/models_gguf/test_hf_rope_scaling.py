"""Hugging Face directories with scaled rope (config.json rope_scaling / rope_parameters):
Llama 3.1 / 3.2 "llama3", "linear" and "yarn" (Qwen2.5, ...) give transformers' logits past
original_max_position_embeddings; rope types whose frequencies follow the sequence length
("dynamic", "longrope") or that Duplex does not know are one ModelLoadError naming them,
never a model that runs with plain rope."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from duplex.engine.models.args import ModelLoadError, hf_config_to_args

from tests.models_gguf.conftest import _COMMON, duplex_logits, hf_logits, llama3_rope_freqs

NUM_TOKENS, ORIGINAL = 200, 64  # the prompt runs well past the original context
ATOL = 1e-3
ROPES = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
}
CASES = [("Llama", "llama3"), ("Llama", "linear"), ("Llama", "yarn"), ("Qwen2", "yarn"),
         ("Qwen3", "linear")]


def prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(1).integers(3, 384, NUM_TOKENS)]


def build(prefix: str, rope: str, root, old_layout: bool = False):
    """A tiny random transformers model with `rope`, saved under root; `old_layout` rewrites
    its config.json as Llama 3.1's is (rope_theta + rope_scaling, no rope_parameters)."""
    import transformers

    extra = dict(head_dim=32) if prefix == "Qwen3" else {}
    config = getattr(transformers, f"{prefix}Config")(**{
        **_COMMON, "num_hidden_layers": 2, "max_position_embeddings": 256, **extra,
        "rope_parameters": dict(ROPES[rope], rope_theta=10000.0)})
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    path = root / f"{prefix}-{rope}{'-old' if old_layout else ''}"
    model.save_pretrained(path, safe_serialization=True)
    if old_layout:
        cfg = json.loads((path / "config.json").read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("prefix,rope", CASES)
def test_scaled_rope_logits_equal_transformers_past_the_original_context(prefix, rope,
                                                                         tmp_path):
    path = build(prefix, rope, tmp_path)
    ids = prompt()
    expected = hf_logits(path, ids)
    ours = duplex_logits(str(path), ids)
    assert torch.allclose(ours, expected, atol=ATOL, rtol=0), \
        float((ours - expected).abs().max())
    assert (ours[ORIGINAL:].argmax(-1) == expected[ORIGINAL:].argmax(-1)).all()


def test_llama31_config_layout_equals_transformers(tmp_path):
    """Llama 3.1's own config.json layout: rope_theta at the top, rope_scaling with the
    llama3 parameters; the factors equal the test's independent converter formula."""
    path = build("Llama", "llama3", tmp_path, old_layout=True)
    ids = prompt()
    expected = hf_logits(path, ids)
    ours = duplex_logits(str(path), ids)
    assert torch.allclose(ours, expected, atol=ATOL, rtol=0), \
        float((ours - expected).abs().max())
    config = json.loads((path / "config.json").read_text())
    factors = hf_config_to_args(config).rope_scaling["freq_factors"]
    reference = llama3_rope_freqs({**config, "rope_parameters": {
        **config["rope_scaling"], "rope_theta": config["rope_theta"]}})
    assert np.allclose(factors, reference, rtol=1e-6, atol=0)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and any(1 < f < 8 for f in factors)


def test_plain_rope_would_not_match(tmp_path):
    """The comparison above sees the scaling: the same weights with the rope_scaling removed
    from config.json are far from transformers' logits past the original context."""
    path = build("Llama", "yarn", tmp_path, old_layout=True)
    ids = prompt()
    expected = hf_logits(path, ids)
    config = json.loads((path / "config.json").read_text())
    del config["rope_scaling"]
    (path / "config.json").write_text(json.dumps(config))
    plain = duplex_logits(str(path), ids)
    assert float((plain[ORIGINAL:] - expected[ORIGINAL:]).abs().max()) > 100 * ATOL


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("rope", [
    dict(rope_type="dynamic", factor=2.0), dict(type="dynamic", factor=2.0),
    dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8),
    dict(rope_type="su", factor=2.0)])
def test_unsupported_rope_types_are_refused_by_name(arch, rope):
    config = dict(model_type=arch, vocab_size=384, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, rope_theta=10000.0,
                  rope_scaling=rope)
    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ModelLoadError, match=f"{arch} with rope_type '{kind}' is not supported"):
        hf_config_to_args(config)

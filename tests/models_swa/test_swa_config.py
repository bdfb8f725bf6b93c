"""Which layers slide, and with which rope, derived from config.json as transformers does."""
from __future__ import annotations

import pytest

from duplex.engine.models.loader import FULL, SLIDING, ModelLoadError, hf_config_to_args

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2)


def hf_windows(config) -> list[int | None]:
    """Per-layer window as transformers' attention modules see it."""
    types = getattr(config, "layer_types", None) or [SLIDING] * config.num_hidden_layers
    return [config.sliding_window if t == SLIDING else None for t in types]


def hf_config(arch: str, **kwargs):
    import transformers as tf

    cls = {"mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
           "gemma3_text": tf.Gemma3TextConfig}[arch]
    return cls(**SMALL, **kwargs)


@pytest.mark.parametrize("arch, kwargs", [
    ("mistral", dict(num_hidden_layers=3, sliding_window=16)),
    ("mistral", dict(num_hidden_layers=3, sliding_window=None)),
    ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                   max_window_layers=2)),
    ("qwen2", dict(num_hidden_layers=4, use_sliding_window=False, sliding_window=16,
                   max_window_layers=2)),
    ("qwen3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                   max_window_layers=3)),
    ("gemma3_text", dict(num_hidden_layers=13, sliding_window=16)),
    ("gemma3_text", dict(num_hidden_layers=5, sliding_window=16, sliding_window_pattern=2)),
    ("gemma3_text", dict(num_hidden_layers=3, sliding_window=16,
                         layer_types=[FULL, SLIDING, FULL])),
])
def test_layer_windows_match_transformers(arch, kwargs):
    config = hf_config(arch, **kwargs)
    if arch == "mistral" and config.sliding_window is None:
        expected = [None] * config.num_hidden_layers
    else:
        expected = hf_windows(config)
    assert hf_config_to_args(config.to_dict()).layer_windows == expected


def test_qwen2_layer_types_default_from_max_window_layers():
    """Old config.json files carry no layer_types: layers >= max_window_layers slide."""
    config = dict(model_type="qwen2", **SMALL, num_hidden_layers=4, use_sliding_window=True,
                  sliding_window=16, max_window_layers=1)
    assert hf_config_to_args(config).layer_windows == [None, 16, 16, 16]
    config["use_sliding_window"] = False
    assert hf_config_to_args(config).layer_windows == [None] * 4


def test_gemma3_flat_rope_keys_equal_rope_parameters():
    """Hub configs carry rope_theta / rope_local_base_freq / rope_scaling; transformers 5
    saves rope_parameters per layer type. Both read the same."""
    flat = dict(model_type="gemma3_text", **SMALL, num_hidden_layers=6, head_dim=8,
                sliding_window=16, rope_theta=5000.0, rope_local_base_freq=100.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=16,
                final_logit_softcapping=30.0)
    saved = hf_config("gemma3_text", **{k: v for k, v in flat.items()
                                         if k not in ("model_type", *SMALL)}).to_dict()
    assert "rope_theta" not in saved and "sliding_attention" in saved["rope_parameters"]
    for config in (flat, saved):
        args = hf_config_to_args(config)
        assert (args.rope_theta, args.rope_local_theta) == (5000.0, 100.0)
        assert args.rope_scaling["factor"] == 8.0
        assert (args.query_pre_attn_scalar, args.final_logit_softcapping) == (16.0, 30.0)
        assert args.layer_windows == [16] * 5 + [None]
        assert args.tie_word_embeddings and args.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("config, message", [
    (dict(model_type="gemma3"), "multimodal"),
    (dict(model_type="gemma3_text", **SMALL, num_hidden_layers=2, sliding_window=8,
          use_bidirectional_attention=True), "bidirectional"),
    (dict(model_type="gemma3_text", **SMALL, num_hidden_layers=2, sliding_window=8,
          rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(model_type="qwen2", **SMALL, num_hidden_layers=2, use_sliding_window=False,
          layer_types=[FULL, SLIDING]), "no sliding_window"),
    (dict(model_type="qwen2", **SMALL, num_hidden_layers=2, layer_types=[FULL]),
     "layer_types for 2 layers"),
])
def test_unsupported_configs_are_refused(config, message):
    with pytest.raises(ModelLoadError, match=message):
        hf_config_to_args(config)

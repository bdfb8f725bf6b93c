"""DeepSeek V2 / V3 GGUF files (llama.cpp's deepseek2 architecture: MLA + MoE) run on Duplex's
DeepSeek-V3 model: tiny random DeepseekV3ForCausalLM models written the way llama.cpp's
converter lays them out (older files with attn_kv_b, newer ones with attn_k_b / attn_v_b)
give transformers' logits and greedy tokens; a file lacking a tensor is one ModelLoadError."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from duplex.engine.models import loader
from duplex.engine.models.args import ModelLoadError

from tests.models_gguf.conftest import deepseek2_metadata, deepseek2_tensors, duplex_logits, \
    hf_logits
from tests.models_gguf.test_gguf_archs import duplex_greedy, reference

MODELS = ["deepseek_v3", "deepseek_lite_yarn"]
ATOL = 1e-3


def deepseek_file(model, split_kv_b: bool, drop: str | None = None, **meta) -> str:
    tensors = deepseek2_tensors(model.state, model.config, split_kv_b)
    if drop is not None:
        del tensors[drop]
    tag = ("-split" if split_kv_b else "") + (f"-no-{drop}" if drop else "") + \
        "".join(f"-{k}{v}" for k, v in meta.items())
    return model.gguf("F32", tensors=tensors,
                      meta=deepseek2_metadata(model.config, split_kv_b) | meta, tag=tag)


@pytest.mark.parametrize("split_kv_b", [False, True], ids=["kv_b", "k_b+v_b"])
@pytest.mark.parametrize("name", MODELS)
def test_deepseek2_gguf_logits_equal_transformers(tiny_model, name, split_kv_b):
    """100 tokens: past the yarn model's original context (64)."""
    model = tiny_model(name)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 384, 100)]
    expected = hf_logits(model.hf_dir, ids)
    ours = duplex_logits(deepseek_file(model, split_kv_b), ids)
    assert torch.allclose(ours, expected, atol=ATOL, rtol=0), \
        float((ours - expected).abs().max())


@pytest.mark.parametrize("name", MODELS)
def test_deepseek2_gguf_greedy_equals_transformers(tiny_model, name):
    model = tiny_model(name)
    assert duplex_greedy(deepseek_file(model, True)) == reference(str(model.hf_dir))


@pytest.mark.parametrize("name", MODELS)
def test_deepseek2_metadata_gives_the_configs_args(tiny_model, name):
    model = tiny_model(name)
    from_hf = loader.check(str(model.hf_dir))
    for split in (False, True):
        from_gguf = loader.check(deepseek_file(model, split))
        assert from_gguf.arch == "deepseek_v3"
        fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "mla", "moe", "rope_theta",
                  "tie_word_embeddings", "max_position_embeddings")
        assert {f: getattr(from_gguf, f) for f in fields} == \
            {f: getattr(from_hf, f) for f in fields}


@pytest.mark.parametrize("drop, split", [("blk.1.attn_kv_a_mqa.weight", False),
                                         ("blk.2.ffn_up_exps.weight", False),
                                         ("blk.0.attn_v_b.weight", True)])
def test_missing_tensor_is_one_load_error_naming_the_file(tiny_model, drop, split):
    path = deepseek_file(tiny_model("deepseek_v3"), split, drop=drop)
    with pytest.raises(ModelLoadError) as error:
        loader.check(path)
    assert str(error.value) == f"{path}: tensor {drop} is missing (the metadata implies it)"


def test_router_bias_is_optional(tiny_model):
    """llama.cpp reads a deepseek2 router without exp_probs_b as one with a zero bias."""
    model = tiny_model("deepseek_v3")
    state = loader.load(deepseek_file(model, False, drop="blk.2.exp_probs_b.bias"),
                        progress=False).state_dict
    assert torch.equal(state["model.layers.2.mlp.gate.e_score_correction_bias"], torch.zeros(8))
    assert not torch.equal(state["model.layers.1.mlp.gate.e_score_correction_bias"],
                           torch.zeros(8))


def test_quantized_deepseek2_gguf_greedy_equals_transformers_on_its_weights(tiny_model):
    model = tiny_model("deepseek_v3")
    path = model.gguf("Q8_0")  # older layout (attn_kv_b): its rows round as the checkpoint's
    assert duplex_greedy(path) == reference(str(model.reference_dir("Q8_0")))


def test_unknown_gating_is_refused(tiny_model):
    """expert_gating_func 1 (softmax: DeepSeek V2 / V2.5, tests/models_gguf/test_deepseek_v2.py)
    and 2 (sigmoid: V3 / R1) run; any other is refused by name."""
    path = deepseek_file(tiny_model("deepseek_v3"), False, expert_gating_func=3)
    with pytest.raises(ModelLoadError) as error:
        loader.check(path)
    assert str(error.value) == (
        f"{path}: deepseek2 with expert_gating_func 3 is not supported; softmax (1, DeepSeek "
        "V2 / V2.5) and sigmoid (2, DeepSeek V3 / R1) are")

"""DeepSeek V2 / V2.5 routing (softmax scores; with topk_method group_limited_greedy only the
`topk_group` groups with the best single score compete; the top-k weights are not
renormalised and are multiplied by routed_scaling_factor) on Duplex's DeepSeek model: tiny
transformers DeepseekV2ForCausalLM directories (model_type deepseek_v2) and the deepseek2 GGUF
files llama.cpp writes for them (expert_gating_func 1, or no such key in older files) give
transformers' logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from duplex.engine.models import loader
from duplex.engine.models.args import ModelLoadError, hf_config_to_args

from tests.models_gguf.conftest import deepseek2_metadata, deepseek2_tensors, duplex_logits, \
    hf_logits

MODELS = ["deepseek_v2", "deepseek_v2_lite_yarn"]
ATOL = 1e-3


def prompt() -> list[int]:
    """100 tokens: past the yarn model's original context (64)."""
    return [int(t) for t in np.random.default_rng(2).integers(3, 384, 100)]


def softmax_file(model, gating: int | None, split_kv_b: bool = False) -> str:
    """The model as llama.cpp writes a V2 file: expert_gating_func `gating` (None: absent)."""
    tensors = deepseek2_tensors(model.state, model.config, split_kv_b)
    meta = deepseek2_metadata(model.config, split_kv_b)
    del meta["expert_gating_func"]
    if gating is not None:
        meta["expert_gating_func"] = gating
    return model.gguf("F32", tensors=tensors, meta=meta,
                      tag=f"-gating{gating}" + ("-split" if split_kv_b else ""))


@pytest.mark.parametrize("name", MODELS)
def test_deepseek_v2_hf_logits_equal_transformers(tiny_model, name):
    model = tiny_model(name)
    ids = prompt()
    expected = hf_logits(model.hf_dir, ids)
    ours = duplex_logits(str(model.hf_dir), ids)
    assert torch.allclose(ours, expected, atol=ATOL, rtol=0), \
        float((ours - expected).abs().max())
    args = loader.check(str(model.hf_dir))
    assert args.arch == "deepseek_v2" and args.moe.scoring == "softmax"
    assert not args.moe.norm_topk_prob


@pytest.mark.parametrize("gating, split_kv_b", [(1, False), (None, True)])
@pytest.mark.parametrize("name", MODELS)
def test_softmax_deepseek2_gguf_logits_equal_transformers(tiny_model, name, gating,
                                                          split_kv_b):
    model = tiny_model(name)
    ids = prompt()
    expected = hf_logits(model.hf_dir, ids)
    ours = duplex_logits(softmax_file(model, gating, split_kv_b), ids)
    assert torch.allclose(ours, expected, atol=ATOL, rtol=0), \
        float((ours - expected).abs().max())


def test_sigmoid_routing_would_not_match(tiny_model):
    """The comparison sees the scoring: the same V2 weights routed as V3 (sigmoid) are far
    from transformers' logits."""
    model = tiny_model("deepseek_v2")
    ids = prompt()
    expected = hf_logits(model.hf_dir, ids)
    ours = duplex_logits(softmax_file(model, 2), ids)
    assert float((ours - expected).abs().max()) > 100 * ATOL


def test_group_limit_uses_each_groups_best_score():
    """Softmax routing ranks a group by its best expert (V3 sums the best two): a group with
    one strong expert beats one with two medium ones."""
    from duplex.engine.models.args import MoEArgs
    from duplex.engine.models.moe import grouped_topk

    moe = MoEArgs(num_experts=4, top_k=1, intermediate_size=8, moe_layers=(0,),
                  norm_topk_prob=False, num_groups=2, topk_groups=1, scoring="softmax",
                  routed_scaling_factor=2.0)
    probs = torch.tensor([[0.3, 0.29, 0.4, 0.01]])  # groups: experts 0, 1 | 2, 3
    weights, ids = grouped_topk(probs.log(), None, moe)
    assert ids.tolist() == [[2]]  # by the sum of the best two, group 0 (0.59 > 0.41) and 0
    assert torch.allclose(weights, 2.0 * probs[:, 2:3], atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(norm_topk_prob=True), "deepseek_v2 with norm_topk_prob is not supported"),
    (dict(topk_method="noaux_tc"), "deepseek_v2 with topk_method 'noaux_tc' is not supported")])
def test_deepseek_v2_configs_it_cannot_follow_are_refused(tiny_model, change, message):
    config = dict(tiny_model("deepseek_v2").config, **change)
    with pytest.raises(ModelLoadError, match=message):
        hf_config_to_args(config)

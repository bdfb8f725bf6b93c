"""MoE pieces against transformers' modules and plain loops: routers, the expert block, load
statistics, the MLA cache layout, config parsing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from duplex.engine.eplb import Placement
from duplex.engine.eplb import compute_placement, route
from duplex.engine.expert_parallel import (_source_rank, _Tables, occurrence, route_on_device,
                                    token_bounds)
from duplex.engine.messages import AddRequest
from duplex.engine.model_runner import ModelRunner
from duplex.engine.models.loader import ModelLoadError, hf_config_to_args
from duplex.engine.models.moe import (ExpertWeights, LocalExperts, MoEArgs, count_pairs,
                               grouped_topk, run_experts, softmax_topk)
from duplex.engine.sampling_params import SamplingParams
from duplex.kernels.fused_moe import fused_moe_ref
from tests.engine.conftest import hf_model, make_core, run_engine


def _sorted_by_id(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def test_softmax_router_matches_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8))
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(0))
    _, want_weights, want_ids = router(x)
    moe = MoEArgs(num_experts=8, top_k=2, intermediate_size=1, moe_layers=(0,),
                  norm_topk_prob=True)
    weights, ids = softmax_topk(torch.nn.functional.linear(x, router.weight.detach()), moe)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.detach(), atol=1e-6, rtol=0)


def test_grouped_router_matches_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2,
                              num_experts_per_tok=4, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    _, want_weights, want_ids = router(x)
    moe = MoEArgs(num_experts=16, top_k=4, intermediate_size=1, moe_layers=(0,),
                  norm_topk_prob=True, num_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    weights, ids = grouped_topk(x @ router.weight.detach().T, router.e_score_correction_bias,
                                moe)
    want_weights, want_ids = _sorted_by_id(want_weights.detach(), want_ids)
    weights, ids = _sorted_by_id(weights, ids)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=0)
    # the chosen experts lie in at most topk_group groups (of 4 experts each)
    assert max(len(set((ids[t] // 4).tolist())) for t in range(64)) <= 2


def test_expert_block_matches_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter, k = 6, 16, 24, 3
    weights = ExpertWeights(torch.randn(num_experts, 2 * inter, hidden, generator=gen),
                            torch.randn(num_experts, hidden, inter, generator=gen))
    x = torch.randn(20, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(20)])
    topk_weights = torch.rand(20, k, generator=gen)
    experts = LocalExperts([weights])
    got = experts.forward(0, x, ids, topk_weights)
    want = torch.zeros_like(x)
    for t in range(20):
        for j in range(k):
            gate, up = (weights.w13[ids[t, j]] @ x[t]).split(inter)
            mlp = weights.w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up)
            want[t] += topk_weights[t, j] * mlp
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # the fused kernels' reference (the CUDA path's definition) is this CPU path, bitwise
    assert torch.equal(fused_moe_ref(x, ids, topk_weights, *weights), got)
    experts.end_step()
    report = experts.load_report()
    assert report.expert_load.tolist() == [np.bincount(ids.flatten(), minlength=6).tolist()]
    assert report.rank_load.tolist() == [[60]] and report.imbalance.tolist() == [1.0]


def test_rows_with_no_expert_come_out_zero_and_leave_the_others_alone():
    gen = torch.Generator().manual_seed(1)
    weights = ExpertWeights(torch.randn(4, 2 * 8, 16, generator=gen),
                            torch.randn(4, 16, 8, generator=gen))
    x = torch.randn(12, 16, generator=gen)
    ids = torch.randint(0, 4, (12,), generator=gen)
    idle = ids.clone()
    idle[::2] = 4  # no expert
    got, want = run_experts(x, idle, weights), run_experts(x, ids, weights)
    assert torch.equal(got[::2], torch.zeros_like(got[::2]))
    # the same rows' values: bitwise with AVX-512 GEMMs; an AVX2 GEMM's blocking follows the
    # row count, so there only to float32 rounding
    torch.testing.assert_close(got[1::2], want[1::2], rtol=1e-5, atol=1e-5)
    assert count_pairs(idle, 5).tolist() == np.bincount(idle, minlength=5).tolist()


def test_load_stats_recorded_during_forward(tiny_moe):
    core = make_core(tiny_moe("qwen3_moe"))
    prompts = [[5] * 7, list(range(11))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    run_engine(core, prompts, params)
    report = core.model.expert_load()
    num_tokens = 7 + 11 + 2 * 3  # every prompt token, then 3 decode steps (the 4th is sampled)
    assert report.expert_load.shape == (2, 8)  # layers 0 and 2 are MoE, layer 1 dense
    assert report.expert_load.sum(axis=1).tolist() == [num_tokens * 2] * 2  # top-2
    moe = report.stats()
    assert moe.imbalance_max == 1.0 and moe.rank_tokens[0] == 4 * num_tokens


def test_mla_cache_holds_the_latent_split_over_k_and_v(tiny_moe):
    """The paged pool holds transformers' compressed cache [c_kv | k_pe] and nothing else."""
    path = tiny_moe("deepseek_v3")
    core = make_core(path, block_size=8)
    args = core.args
    latent = args.mla.kv_lora_rank + args.mla.qk_rope_head_dim
    assert (args.num_kv_heads, args.head_dim) == (1, latent // 2)
    assert ModelRunner.bytes_per_block(args, 8, torch.float32) == args.num_layers * 8 * latent * 4
    prompt = list(range(3, 23))
    core.add_request(AddRequest("r", prompt, SamplingParams(temperature=0, max_tokens=2)))
    core.step()  # the prefill
    blocks = torch.tensor(core.kv.block_ids("r"))
    out = hf_model(path)(torch.tensor([prompt]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    for layer in range(args.num_layers):
        planes = core.runner.kv[layer][:, blocks].reshape(2, -1, latent // 2)[:, :len(prompt)]
        got = torch.cat([planes[0], planes[1]], dim=-1)  # [positions, latent]
        want = torch.cat([cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]], -1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_deepseek_v3_config_parsing():
    config = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
                  intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                  num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                  n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                  q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                  topk_group=4, n_group=8, num_experts_per_tok=8, first_k_dense_replace=3,
                  norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000,
                  rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1,
                                    mscale=1.0, mscale_all_dim=1.0,
                                    original_max_position_embeddings=4096))
    args = hf_config_to_args(config)
    assert args.moe.moe_layers == tuple(range(3, 61))
    assert (args.moe.num_groups, args.moe.topk_groups, args.moe.top_k) == (8, 4, 8)
    assert args.moe.shared_intermediate_size == 2048
    assert (args.num_kv_heads, args.head_dim) == (1, 288)  # 576-wide latent, two planes
    assert args.rope_scaling["rope_type"] == "yarn"
    with pytest.raises(ModelLoadError, match="sliding window"):
        hf_config_to_args(dict(config, model_type="mixtral", sliding_window=4096,
                               num_local_experts=8))


def test_token_bounds_and_copy_sources():
    assert token_bounds(2, 4).tolist() == [0, 0, 1, 1, 2]
    assert token_bounds(10, 4).tolist() == [0, 2, 5, 7, 10]
    old = Placement(np.array([[0, 1, 0, 2, 3, 1]]), 4, (3, 3))  # rank 0: 0 1 0; rank 1: 2 3 1
    assert _source_rank(old, 0, 1, dst=1) == 1  # already there: a local copy
    assert _source_rank(old, 0, 0, dst=1) == 0
    assert _source_rank(old, 0, 3, dst=0) == 1


def test_step_counts_are_recorded_once_per_step():
    """A step's counts stay where the ids are (in place, nothing read back) and reach the
    statistics in end_step; the next step starts from zero."""
    weights = ExpertWeights(torch.zeros(4, 2, 3), torch.zeros(4, 3, 1))
    experts = LocalExperts([weights, weights])
    for layer, ids in ((0, [[0, 1], [1, 3]]), (1, [[2, 2]]), (0, [[3, 3]])):
        experts.step_counts.add(layer, torch.tensor(ids))
    experts.end_step()
    assert experts.load_report().expert_load.tolist() == [[1, 2, 0, 3], [0, 0, 2, 0]]
    assert experts.step_counts.take().sum() == 0
    experts.step_counts.add(1, torch.tensor([[1, 1]]))
    experts.end_step()
    assert experts.load_report().expert_load.tolist() == [[1, 2, 0, 3], [0, 2, 2, 0]]


@pytest.mark.parametrize("seed", range(4))
def test_device_routing_is_the_host_router_from_zero_load(seed):
    """The EP forward's routing on the device gives the slots `eplb.route` gives (host,
    water-filling from an all-zero load), replicas dealt round-robin in pair order."""
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 100, size=(3, 8)) * (rng.random((3, 8)) < 0.7)
    placement = compute_placement(load, num_ranks=4, num_redundant=4 + seed)
    tables = _Tables.of(placement, torch.device("cpu"))
    assert placement.replica_count.max() > 1
    for layer in range(3):
        ids = torch.from_numpy(rng.integers(0, 8, size=(int(rng.integers(1, 40)), 2)))
        want = route(ids.numpy(), placement, layer, np.zeros(placement.num_slots))
        assert route_on_device(ids, tables, layer).tolist() == want.reshape(-1).tolist()
    assert occurrence(torch.tensor([2, 0, 2, 2, 1, 0]), 3).tolist() == [0, 0, 1, 2, 0, 1]

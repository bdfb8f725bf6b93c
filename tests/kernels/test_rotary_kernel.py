"""Rotary embedding: the reference equals transformers' apply_rotary_pos_emb bitwise."""
import pytest
import torch

from duplex.kernels.rotary import rope_cos_sin_cache, rotary_embedding_ref

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def _hf_cos_sin(cache, positions):
    cos, sin = cache[positions].chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _qk(num_tokens, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, 6, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, 2, head_dim, generator=gen).to(dtype)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neox_equals_transformers_bitwise(dtype):
    cache = rope_cos_sin_cache(32, 100)
    positions = torch.tensor([0, 3, 99, 41, 41])
    q, k = _qk(5, 32, dtype)
    cos, sin = _hf_cos_sin(cache, positions)
    # HF layout [num_tokens, heads, head_dim] -> unsqueeze cos/sin on the heads dim
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype),
                                                     unsqueeze_dim=1)
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cache)
    assert torch.equal(q_rot, hf_q) and torch.equal(k_rot, hf_k)


def test_cache_equals_transformers_rotary_embedding():
    config = modeling_llama.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                        max_position_embeddings=64)
    rope = modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(64)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    expected_cos, expected_sin = _hf_cos_sin(rope_cos_sin_cache(32, 64, config.rope_parameters["rope_theta"]),
                                             positions[0])
    assert torch.equal(cos[0], expected_cos) and torch.equal(sin[0], expected_sin)


def test_partial_rotary_and_gptj_against_definition():
    cache = rope_cos_sin_cache(8, 16)
    positions = torch.tensor([1, 7, 15])
    q, k = _qk(3, 12, torch.float32, seed=2)
    q_rot, _ = rotary_embedding_ref(positions, q, k, cache, is_neox=False)
    cos, sin = cache[positions].chunk(2, dim=-1)  # [3, 4]
    even, odd = q[..., 0:8:2], q[..., 1:8:2]
    assert torch.equal(q_rot[..., 0:8:2], even * cos[:, None] - odd * sin[:, None])
    assert torch.equal(q_rot[..., 1:8:2], odd * cos[:, None] + even * sin[:, None])
    assert torch.equal(q_rot[..., 8:], q[..., 8:])
    q_neox, _ = rotary_embedding_ref(positions, q, k, cache, is_neox=True)
    assert torch.equal(q_neox[..., 8:], q[..., 8:])


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_triton_matches_reference(device, is_neox, rotary_dim):
    from duplex.kernels.rotary import rotary_embedding_triton
    cache = rope_cos_sin_cache(rotary_dim, 50)
    positions = torch.tensor([0, 49, 7, 7, 20])
    q, k = _qk(5, 16, torch.float32, seed=3)
    expected = rotary_embedding_ref(positions, q, k, cache, is_neox)
    got = rotary_embedding_triton(positions.to(device), q.to(device), k.to(device),
                                  cache.to(device), is_neox)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g.cpu(), e, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
def test_triton_large_bf16():
    from duplex.kernels.rotary import rotary_embedding_triton
    cache = rope_cos_sin_cache(128, 8192).cuda()
    positions = torch.randint(0, 8192, (4096,), device="cuda")
    q, k = (t.cuda() for t in _qk(4096, 128, torch.bfloat16))
    for e, g in zip(rotary_embedding_ref(positions, q, k, cache),
                    rotary_embedding_triton(positions, q, k, cache)):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)

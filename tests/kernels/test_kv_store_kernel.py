"""Paged KV store: tokens land in their slots, negative slots are skipped."""
import pytest
import torch

from duplex.kernels.kv_store import store_kv_ref


def _store_case(num_tokens=5, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return k, v, k_cache, v_cache, slots


def test_reference_writes_block_and_offset():
    k, v, k_cache, v_cache, slots = _store_case()
    slots[1] = -1
    store_kv_ref(k, v, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, k_cache.shape[1])
            assert torch.equal(k_cache[block, offset], k[token])
            assert torch.equal(v_cache[block, offset], v[token])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == len(slots) - 1


def test_triton_matches_reference(device):
    from duplex.kernels.kv_store import store_kv_triton
    k, v, k_cache, v_cache, slots = _store_case(num_tokens=7, num_blocks=3, head_dim=6)
    slots[2] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    on = [t.to(device) for t in (k, v, k_cache, v_cache, slots)]
    store_kv_triton(*on)
    assert torch.equal(on[2].cpu(), expected_k) and torch.equal(on[3].cpu(), expected_v)


@pytest.mark.gpu
def test_triton_large_bf16():
    from duplex.kernels.kv_store import store_kv_triton
    k, v, k_cache, v_cache, slots = _store_case(4000, 512, 16, 8, 128)
    args = [t.to("cuda") for t in (k.bfloat16(), v.bfloat16(), k_cache.bfloat16(),
                                   v_cache.bfloat16(), slots)]
    expected = [t.clone() for t in args]
    store_kv_ref(*expected)
    store_kv_triton(*args)
    assert torch.equal(args[2], expected[2]) and torch.equal(args[3], expected[3])

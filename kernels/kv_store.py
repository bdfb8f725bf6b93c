"""Paged KV store: write new tokens' keys and values into their cache slots.

Cache layout `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is
`block_id * block_size + offset`, so the cache viewed as `[num_slots, num_kv_heads, head_dim]`
is indexed by slot directly. A negative slot means "padding token, do not write".
"""
import torch

from kernels._triton import require_triton, tl, triton


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference; writes k_cache / v_cache in place."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k_cache.shape[2:]
    slots = slot_mapping
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    # caches viewed as [num_slots, num_kv_heads, head_dim]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
    assert k.dim() == 3 and k.shape == v.shape, (
        f"k and v must both be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)} "
        f"and {tuple(v.shape)}")
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    assert k_cache.shape[2:] == k.shape[1:], (
        f"cache heads/head_dim {tuple(k_cache.shape[2:])} differ from k's {tuple(k.shape[1:])}")
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    assert slot_mapping.shape == (k.shape[0],), (
        f"slot_mapping must be [num_tokens={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    assert k.device == k_cache.device == slot_mapping.device, "all tensors must be on one device"

"""Paged KV store: write new tokens' keys and values into their cache slots.

Cache layout `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is
`block_id * block_size + offset`, so the cache viewed as `[num_slots, num_kv_heads, head_dim]`
is indexed by slot directly. A negative slot means "padding token, do not write".
"""
import torch

from duplex.kernels._triton import require_triton, tl, triton


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 all_valid: bool | None = None) -> None:
    """Torch reference; writes k_cache / v_cache in place. `all_valid=True`: the caller
    vouches that no slot is negative, so the check (a host sync) is skipped."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k_cache.shape[2:]
    slots = slot_mapping
    if not all_valid and bool((slots < 0).any()):
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


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k_token,
                     stride_v_token, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token: copy its `[num_kv_heads * head_dim]` row of k and v to its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    offs = tl.arange(0, BLOCK)
    mask = offs < tl.where(slot >= 0, ROW, 0)  # a padding token writes nothing
    k = tl.load(k_ptr + token * stride_k_token + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton launcher; same contract as `store_kv_ref`."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    require_triton(k, v, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k.shape[1:]
    for name, t in (("k", k), ("v", v)):
        # one kv head (MLA's latent halves): its stride is never used
        assert t.stride(2) == 1 and (num_kv_heads == 1 or t.stride(1) == head_dim), (
            f"{name} must have contiguous [num_kv_heads, head_dim] rows (a token-strided view is "
            f"fine), got strides {t.stride()}")
    row = num_kv_heads * head_dim
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))

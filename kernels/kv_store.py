"""Paged KV store: write new tokens' keys and values into their cache slots.

Cache layout `[num_blocks, block_size, num_kv_heads, row]`; a slot is
`block_id * block_size + offset`, so the cache viewed as `[num_slots, num_kv_heads, row]`
is indexed by slot directly. A negative slot means "padding token, do not write".

A float cache's row is the head's `head_dim` values. An int8 cache (`--kv-cache-dtype int8`)
packs each (token, kv head) row into `head_dim + 4` bytes:

    bytes [0, head_dim)             round(x / scale) clamped to [-127, 127], int8
    bytes [head_dim, head_dim + 4)  scale = absmax(x) / 127, fp32 little-endian (0: x == 0)

so the pool stays one tensor whose blocks are plain bytes (tiers, hand-off and disk move
them unchanged) and a row dequantizes on its own (`dequantize_rows`), independent of every
other row: batch invariance holds. head_dim % 4 == 0 keeps the scale 4-byte aligned.
Rounding is half away from zero, the same in the torch reference and the triton kernel.
"""
import torch

from duplex.kernels._triton import require_triton, tl, triton

SCALE_BYTES = 4  # an int8 row's fp32 scale, after its head_dim values
INT8_ENCODING = "int8+f32scale"  # what the tiers record for such a pool's blocks


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row of a cache of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a cache `[..., row]` holds (its row less the int8 scale)."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype == torch.int8 else 0)


def kv_encoding(dtype: torch.dtype) -> str:
    """How a pool of `dtype` encodes its values: "" (the elements are the values) or
    INT8_ENCODING."""
    return INT8_ENCODING if dtype == torch.int8 else ""


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x `[..., D]` (any float dtype) -> int8 `[..., D + 4]` packed rows (module docstring)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0  # [..., 1]
    y = x / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (y + 0.5 * torch.sign(y)).clamp_(-127, 127).to(torch.int8)  # the cast truncates
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 packed rows `[..., D + 4]` -> fp32 `[..., D]`; any other cache's rows as fp32."""
    if rows.dtype != torch.int8:
        return rows.float()
    head_dim = rows.shape[-1] - SCALE_BYTES
    if not rows.is_contiguous():
        rows = rows.contiguous()
    return rows[..., :head_dim].float() * rows[..., head_dim:].view(torch.float32)


def check_cache_dtype(dtype: torch.dtype, head_dim: int) -> None:
    """Refuse an int8 cache for a head_dim whose rows would misalign the fp32 scale."""
    if dtype == torch.int8 and head_dim % SCALE_BYTES:
        raise ValueError(f"--kv-cache-dtype int8 needs head_dim % 4 == 0 (the fp32 scale "
                         f"after each row stays aligned); this model's head_dim is {head_dim}")


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 all_valid: bool | None = None) -> None:
    """Torch reference; writes k_cache / v_cache in place (int8 caches: packed rows).
    `all_valid=True`: the caller vouches that no slot is negative, so the check (a host
    sync) is skipped."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_kv_heads, width = k_cache.shape[2:]
    slots = slot_mapping
    if not all_valid and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    if k_cache.dtype == torch.int8:
        k, v = quantize_rows(k), quantize_rows(v)
    # caches viewed as [num_slots, num_kv_heads, row]
    k_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, v.to(v_cache.dtype))


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
    assert k.dim() == 3 and k.shape == v.shape, (
        f"k and v must both be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)} "
        f"and {tuple(v.shape)}")
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, row], "
        f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    assert (k_cache.shape[2], cache_head_dim(k_cache)) == k.shape[1:], (
        f"cache heads/head_dim {(k_cache.shape[2], cache_head_dim(k_cache))} differ from k's "
        f"{tuple(k.shape[1:])} ({k_cache.dtype} cache)")
    assert k_cache.dtype != torch.int8 or k.shape[2] % SCALE_BYTES == 0, (
        f"an int8 cache needs head_dim % 4 == 0, got {k.shape[2]}")
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


@triton.jit
def _store_kv_int8_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k_token,
                          stride_k_head, stride_v_token, stride_v_head,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: quantize its k and v heads into packed int8 rows at its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < tl.where(slot >= 0, NUM_HEADS, 0)  # a padding token writes nothing
    mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
    rows = slot * (NUM_HEADS * (HEAD_DIM + 4)) + heads * (HEAD_DIM + 4)  # [BLOCK_H] bytes
    store_int8_rows(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head
                    + dims[None, :], k_cache_ptr, rows, dims, mask, head_ok, HEAD_DIM)
    store_int8_rows(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head
                    + dims[None, :], v_cache_ptr, rows, dims, mask, head_ok, HEAD_DIM)


@triton.jit
def store_int8_rows(src, cache_ptr, rows, dims, mask, row_ok, HEAD_DIM: tl.constexpr):
    """Quantize the float tile at `src` [R, BLOCK_D] into packed rows starting at byte
    offsets `rows` [R] of an int8 cache (`quantize_rows`, the same roundings)."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=1) / 127.0  # [R]
    y = x / tl.where(scale > 0, scale, 1.0)[:, None]
    y = y + tl.where(y > 0, 0.5, tl.where(y < 0, -0.5, 0.0))
    q = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)  # the cast truncates
    tl.store(cache_ptr + rows[:, None] + dims[None, :], q, mask=mask)
    tl.store((cache_ptr + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=row_ok)


@triton.jit
def load_int8_rows(cache_ptr, rows, dims, mask, row_ok, HEAD_DIM: tl.constexpr):
    """fp32 `[R, BLOCK_D]`: the packed int8 rows at byte offsets `rows` [R] dequantized
    (masked entries 0)."""
    x = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0).to(tl.float32)
    scale = tl.load((cache_ptr + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                    mask=row_ok, other=0.0)
    return x * scale[:, None]


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
    if k_cache.dtype == torch.int8:
        _store_kv_int8_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim))
        return
    _store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))

"""Rotary position embedding (RoPE) from a precomputed cos/sin cache.

`cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq))`, shape
`[max_positions, rotary_dim]`; the first `rotary_dim` dims of each head are rotated, the rest
pass through. `is_neox=True` pairs dim i with i + rotary_dim/2 (Hugging Face `rotate_half`);
`is_neox=False` pairs dims 2i and 2i+1 (GPT-J). cos/sin are cast to q's dtype and the math is
done in that dtype, as transformers' `apply_rotary_pos_emb` does, so the neox path equals it
bit for bit. Returns new tensors `(q_rot, k_rot)`; the inputs are not modified.
"""
from typing import NamedTuple

import torch

from duplex.kernels._triton import require_triton, tl, triton


def rope_cos_sin_cache(rotary_dim: int, max_positions: int, base: float = 10000.0,
                       inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `[max_positions, rotary_dim]` cache computed as transformers' default RoPE does.

    Pass `inv_freq` for scaled variants (llama3, yarn, ...) computed elsewhere."""
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                                   / rotary_dim))
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq.float()
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor, is_neox: bool = True):
    """Torch reference. Returns `(q_rot, k_rot)`, new tensors shaped like q and k."""
    _check(positions, q, k, cos_sin_cache)
    cos, sin = cos_sin_cache[positions.long()].to(q.dtype).chunk(2, dim=-1)
    # cos, sin: [num_tokens, 1, rotary_dim / 2], broadcast over heads
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


class RopeTables(NamedTuple):
    """A step's rotary factors, gathered once and shared by every layer (neox, full-dim
    rotation): `x_rot = x * cos + roll(x, D/2) * sin_signed`, where roll gives
    `cat(x2, x1)` and sin_signed is `cat(-sin, sin)` — rotate_half(x) * sin exactly."""
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin_signed: torch.Tensor  # [num_tokens, 1, head_dim]


def rope_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                dtype: torch.dtype) -> RopeTables:
    cos, sin = cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
    return RopeTables(torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None])


def apply_rope(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """x `[num_tokens, heads, head_dim]` rotated with prebuilt tables; a new tensor, equal bit
    for bit to `rotary_embedding_ref` (neox) on the same positions."""
    # two products and a sum, each rounded, as transformers does (no fused multiply-add)
    return x * tables.cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * tables.sin_signed


def _rotate(x, cos, sin, is_neox):
    rotary_dim = 2 * cos.shape[-1]
    x_rot = x[..., :rotary_dim]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    # x * cos + rotate_half(x) * sin, written per half; a - b == a + (-b) exactly in IEEE
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    if rotary_dim < x.shape[-1]:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out


def _check(positions, q, k, cos_sin_cache) -> None:
    assert q.dim() == 3 and k.dim() == 3, (
        "q must be [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim], "
        f"got {tuple(q.shape)} and {tuple(k.shape)}")
    assert positions.shape == (q.shape[0],) == (k.shape[0],), (
        f"positions must be [num_tokens], got {tuple(positions.shape)} for q {tuple(q.shape)}")
    assert q.shape[-1] == k.shape[-1] and q.dtype == k.dtype, "q and k must share head_dim, dtype"
    rotary_dim = cos_sin_cache.shape[-1]
    assert cos_sin_cache.dim() == 2 and rotary_dim % 2 == 0 and rotary_dim <= q.shape[-1], (
        f"cos_sin_cache must be [max_positions, rotary_dim <= head_dim, even], "
        f"got {tuple(cos_sin_cache.shape)}")


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_token, stride_head, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  IS_NEOX: tl.constexpr):
    """Rotate the first 2 * HALF dims of every head of one token; out is contiguous."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    if IS_NEOX:
        first = dims
        second = dims + HALF
    else:
        first = 2 * dims
        second = 2 * dims + 1
    src = x_ptr + token * stride_token + heads * stride_head
    x1 = tl.load(src + first, mask=mask, other=0.0)
    x2 = tl.load(src + second, mask=mask, other=0.0)
    dst = out_ptr + (token * num_heads + heads) * stride_head
    tl.store(dst + first, (x1 * cos - x2 * sin).to(x1.dtype), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
                   stride_q_token, stride_k_token, num_heads, num_kv_heads, stride_cache,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """One program per token: look up its cos/sin row once, rotate all q and k heads."""
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(q_ptr.dtype.element_ty)
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(q_ptr.dtype.element_ty)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q_token, HEAD_DIM, num_heads, cos, sin,
                  HALF, BLOCK_H, BLOCK_HALF, IS_NEOX)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k_token, HEAD_DIM, num_kv_heads, cos, sin,
                  HALF, BLOCK_H, BLOCK_HALF, IS_NEOX)


def rotary_embedding_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            cos_sin_cache: torch.Tensor, is_neox: bool = True):
    """Triton launcher; same contract as `rotary_embedding_ref` (returns new tensors)."""
    _check(positions, q, k, cos_sin_cache)
    require_triton(positions, q, k, cos_sin_cache)
    head_dim = q.shape[-1]
    for name, t in (("q", q), ("k", k)):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, (
            f"{name} must have contiguous [heads, head_dim] rows, got strides {t.stride()}")
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache rows must be contiguous"
    rotary_dim = cos_sin_cache.shape[-1]
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format)
    if rotary_dim < head_dim:  # pass-through dims
        q_out[..., rotary_dim:] = q[..., rotary_dim:]
        k_out[..., rotary_dim:] = k[..., rotary_dim:]
    if q.shape[0]:
        _rotary_kernel[(q.shape[0],)](
            positions, q, k, cos_sin_cache, q_out, k_out, q.stride(0), k.stride(0),
            q.shape[1], k.shape[1], cos_sin_cache.stride(0), HEAD_DIM=head_dim,
            HALF=rotary_dim // 2, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
            BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2), IS_NEOX=is_neox)
    return q_out, k_out

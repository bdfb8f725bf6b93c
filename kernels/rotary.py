"""Rotary position embedding (RoPE) from a precomputed cos/sin cache.

`cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq))`, shape
`[max_positions, rotary_dim]`; the first `rotary_dim` dims of each head are rotated, the rest
pass through. `is_neox=True` pairs dim i with i + rotary_dim/2 (Hugging Face `rotate_half`);
`is_neox=False` pairs dims 2i and 2i+1 (GPT-J). cos/sin are cast to q's dtype and the math is
done in that dtype, as transformers' `apply_rotary_pos_emb` does, so the neox path equals it
bit for bit. Returns new tensors `(q_rot, k_rot)`; the inputs are not modified.
"""
import torch

from kernels._triton import require_triton, tl, triton


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

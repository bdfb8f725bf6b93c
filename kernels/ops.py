"""The ops the engine calls. Each picks its implementation from where the tensors live:

    CUDA tensors            -> triton kernel (batch-invariant matmul when that mode is on)
    CPU, batch-invariant on -> kernels.batch_invariant (bitwise independent of batch shape)
    CPU otherwise           -> the torch reference

Conventions (shapes, masks, dtypes) are documented on the reference of each op; every path
follows them.
"""
import torch

from kernels import attention, kv_store, matmul as _matmul, rms_norm as _rms_norm, rotary
from kernels import batch_invariant as bi
from kernels.batch_invariant import is_batch_invariant


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v `[num_tokens, num_kv_heads, head_dim]` into cache slots (in place).
    slot = block_id * block_size + offset; slot < 0 skips the token."""
    if k.is_cuda:
        return kv_store.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return kv_store.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> torch.Tensor:
    """Causal varlen paged attention; see kernels.attention for the exact conventions."""
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window, soft_cap)
    if q.is_cuda:
        return attention.paged_attention_triton(*args)
    if is_batch_invariant():
        return bi.bi_paged_attention(*args)
    return attention.paged_attention_ref(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, offset: float = 0.0):
    """HF RMSNorm (offset=1.0: Gemma3). Returns out, or (out, x + residual) given residual."""
    if x.is_cuda:
        return _rms_norm.rms_norm_triton(x, weight, eps, residual, offset)
    if is_batch_invariant():
        return bi.bi_rms_norm(x, weight, eps, residual, offset)
    return _rms_norm.rms_norm_ref(x, weight, eps, residual, offset)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True):
    """RoPE; returns new tensors (q_rot, k_rot). Elementwise, hence batch invariant as is."""
    if q.is_cuda:
        return rotary.rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox)
    return rotary.rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)


def matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ w_t [K, N]`."""
    if is_batch_invariant():
        if x.is_cuda:
            return _matmul.matmul_triton(x, w_t)
        return bi.bi_matmul(x, w_t)
    return _matmul.matmul_ref(x, w_t)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`x [..., K] @ weight [N, K].T + bias`."""
    if is_batch_invariant():
        if x.is_cuda:
            return _matmul.linear_triton(x, weight, bias)
        return bi.bi_linear(x, weight, bias)
    return _matmul.linear_ref(x, weight, bias)


def log_softmax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 log-softmax; batch invariant on CPU when that mode is on."""
    if is_batch_invariant() and not logits.is_cuda:
        return bi.bi_log_softmax(logits, dim)
    return torch.log_softmax(logits.float(), dim=dim)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU; batch invariant on CPU when that mode is on (torch's silu is not, see
    kernels.batch_invariant)."""
    if is_batch_invariant() and not x.is_cuda:
        return bi.bi_silu(x)
    return torch.nn.functional.silu(x)

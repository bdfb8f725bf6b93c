"""The ops the engine calls. Each picks its implementation from where the tensors live:

    CUDA tensors            -> triton kernel (batch-invariant matmul when that mode is on);
                               CPU tensors too inside kernels._triton.on_cpu (interpreter)
    CPU, batch-invariant on -> kernels.batch_invariant (bitwise independent of batch shape)
    CPU otherwise           -> the torch reference

Conventions (shapes, masks, dtypes) are documented on the reference of each op; every path
follows them.

The kernels package (`duplex.kernels`): each kernel is a triple: triton kernel, launcher with plain-words asserts,
torch reference. The engine calls this module, which picks triton on CUDA and the torch
reference (or, in batch-invariant mode, `duplex.kernels.batch_invariant`) on CPU.

    ops.py              dispatch: store_kv, paged_attention, rms_norm, rotary_embedding,
                        matmul, linear, log_softmax, silu, silu_and_mul,
                        fused_moe
    kv_store.py         paged KV cache write (slot = block_id * block_size + offset)
    attention.py        varlen paged attention: decode + prefill over a cached prefix, GQA,
                        sliding window, soft cap
    decode_attention.py split-KV (flash-decoding) triton attention for decode rows (CUDA)
    activation.py       SiLU-and-mul of a fused gate/up projection
    fused_moe.py        routed SwiGLU experts as grouped GEMMs over expert-sorted rows
    rms_norm.py         RMSNorm (Llama / Gemma3 offset), fused residual add
    rotary.py           RoPE from a cos/sin cache (neox and GPT-J layouts)
    matmul.py           plain matmul/linear; batch-invariant persistent triton matmul
    batch_invariant.py  the batch-invariant switch and its CPU implementations
    _triton.py          the optional triton import
"""
import torch

from duplex.kernels import activation, attention, fused_moe as _fused_moe, kv_store, matmul as _matmul, rms_norm as _rms_norm, rotary
from duplex.kernels import batch_invariant as bi
from duplex.kernels import cpu_fused, decode_attention
from duplex.kernels.attention import AttentionPlan
from duplex.kernels.decode_attention import StepLens
from duplex.kernels.batch_invariant import is_batch_invariant
from duplex.kernels._triton import runs_triton
from duplex.kernels.quant import QuantEmbedding, QuantWeight, fuse
from duplex.kernels.rotary import RopeTables


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, all_valid: bool | None = None) -> None:
    """Write k, v `[num_tokens, num_kv_heads, head_dim]` into cache slots (in place; an int8
    cache takes packed rows, kernels.kv_store).
    slot = block_id * block_size + offset; slot < 0 skips the token. `all_valid`: the
    caller knows there is no negative slot (None: look)."""
    if runs_triton(k):
        return kv_store.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return kv_store.store_kv_ref(k, v, k_cache, v_cache, slot_mapping, all_valid)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, plan: AttentionPlan | None = None,
                    lens: StepLens | None = None) -> torch.Tensor:
    """Causal varlen paged attention; see kernels.attention for the exact conventions.
    `plan` (CPU): the step's prebuilt gather indices and masks for these inputs.
    `lens` (CUDA): the step's host lengths; with them decode rows take the split-KV kernels
    (kernels.decode_attention) and nothing syncs."""
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window, soft_cap)
    if runs_triton(q):
        if lens is not None:
            return decode_attention.paged_attention_split(*args[:7], lens, sliding_window,
                                                          soft_cap)
        return attention.paged_attention_triton(*args)
    if is_batch_invariant():
        return bi.bi_paged_attention(*args)
    if plan is not None:
        return attention.paged_attention_planned(q, k_cache, v_cache, plan, scale, soft_cap)
    return attention.paged_attention_ref(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, offset: float = 0.0,
             out_dtype: torch.dtype | None = None):
    """HF RMSNorm (offset=1.0: Gemma3). Returns out, or (out, x + residual) given residual.
    `out_dtype` (the bf16 matmul stream, see engine/models/llama.py): x may be bf16 beside an
    fp32 residual; the sum and the norm are computed as for `x.float()`, and out is rounded
    once to out_dtype."""
    if out_dtype is not None:
        return _rms_norm_mixed(x, weight, eps, residual, offset, out_dtype)
    if runs_triton(x):
        return _rms_norm.rms_norm_triton(x, weight, eps, residual, offset)
    if is_batch_invariant():
        return bi.bi_rms_norm(x, weight, eps, residual, offset)
    if cpu_fused.is_enabled() and not offset and _fused_norm_fits(x, weight, residual):
        rows = x.reshape(-1, x.shape[-1])
        out = cpu_fused.rms_norm(rows, weight, eps,
                                 None if residual is None else residual.reshape(rows.shape))
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)
    return _rms_norm.rms_norm_ref(x, weight, eps, residual, offset)


def _rms_norm_mixed(x, weight, eps, residual, offset, out_dtype):
    if cpu_fused.is_enabled() and not offset and not is_batch_invariant() \
            and cpu_fused.fits_mixed(x) and cpu_fused.fits(weight) \
            and (residual is None or cpu_fused.fits(residual) and residual.is_contiguous()) \
            and x.is_contiguous() and weight.is_contiguous():
        if x.dim() == 2:  # the engine's case: no reshaping (each costs microseconds)
            return cpu_fused.rms_norm(x, weight, eps, residual, out_dtype)
        rows = x.reshape(-1, x.shape[-1])
        out = cpu_fused.rms_norm(rows, weight, eps, None if residual is None
                                 else residual.reshape(rows.shape), out_dtype)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)
    if residual is not None:
        x = x.to(residual.dtype)
    out = rms_norm(x, weight, eps, residual, offset)
    if residual is None:
        return out.to(out_dtype)
    return out[0].to(out_dtype), out[1]


def _fused_norm_fits(x, weight, residual) -> bool:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return cpu_fused.fits(*tensors) and all(t.is_contiguous() for t in tensors)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True):
    """RoPE; returns new tensors (q_rot, k_rot). Elementwise, hence batch invariant as is."""
    if runs_triton(q):
        return rotary.rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox)
    return rotary.rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)


def apply_rope(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """RoPE (neox, full head) of `x [num_tokens, heads, head_dim]` from a step's tables."""
    return rotary.apply_rope(x, tables)


def rope_and_store_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      all_valid: bool | None = None) -> torch.Tensor:
    """A fused q/k/v projection's output `[T, (heads + 2 kv_heads) D]` (any float dtype):
    rotary (neox, full head) of q and k computed in fp32, k and v stored into the cache
    slots as `store_kv` does; returns q, fp32 `[T, heads, D]`. On the CPU one fused kernel
    (float caches); elsewhere, and for an int8 cache's packed rows, the ops it stands for,
    on `qkv.float()`."""
    if not runs_triton(qkv) and cpu_fused.available() and cpu_fused.fits_mixed(qkv) \
            and cpu_fused.fits(cos_sin_cache) and cos_sin_cache.is_contiguous() \
            and cos_sin_cache.shape[-1] == head_dim and qkv.stride(1) == 1 \
            and positions.dtype == slot_mapping.dtype == torch.int64 \
            and positions.is_contiguous() and slot_mapping.is_contiguous() \
            and k_cache.is_contiguous() and v_cache.is_contiguous() \
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16) \
            and not is_batch_invariant():
        return cpu_fused.rope_store_kv(qkv, heads, kv_heads, head_dim, positions,
                                       cos_sin_cache, slot_mapping, k_cache, v_cache)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.float().split([q_size, kv_size, kv_size], dim=-1)
    q, k = rotary_embedding(positions, q.reshape(-1, heads, head_dim),
                            k.reshape(-1, kv_heads, head_dim), cos_sin_cache)
    store_kv(k, v.reshape(-1, kv_heads, head_dim), k_cache, v_cache, slot_mapping, all_valid)
    return q


def rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """Rotate `x [num_tokens, heads, head_dim]` (neox, full head) in place with the fused CPU
    kernel, bitwise equal to the reference; False (x untouched) where it does not apply."""
    ok = (not runs_triton(x) and cpu_fused.available() and cpu_fused.fits(x, cos_sin_cache)
          and x.stride(2) == 1
          and x.stride(1) == x.shape[2] and positions.dtype == torch.int64
          and positions.is_contiguous() and cos_sin_cache.is_contiguous()
          and cos_sin_cache.shape[-1] == x.shape[-1] and not is_batch_invariant())
    if ok:
        cpu_fused.rope_neox_(x, positions, cos_sin_cache)
    return ok


def matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ w_t [K, N]`."""
    if is_batch_invariant():
        if x.is_cuda:
            return _matmul.matmul_triton(x, w_t)
        return bi.bi_matmul(x, w_t)
    return _matmul.matmul_ref(x, w_t)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """`x [..., K] @ weight [N, K].T + bias`; a QuantWeight runs its weight-only kernel.
    `out_dtype`: the result's dtype (default x's); a bf16 matmul's output is then returned
    without a round trip through x's dtype."""
    if isinstance(weight, QuantWeight):
        return weight.linear(x, bias, out_dtype)
    if out_dtype is not None and out_dtype != x.dtype:
        return linear(x, weight, bias).to(out_dtype)
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


def silu_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[..., 2n]` -> `silu(gate_up[..., :n]) * gate_up[..., n:]`. `out_dtype` (the bf16
    matmul stream): computed as for `gate_up.float()`, rounded once to out_dtype."""
    if out_dtype is not None:
        if cpu_fused.is_enabled() and cpu_fused.fits_mixed(gate_up) and gate_up.is_contiguous() \
                and not is_batch_invariant():
            if gate_up.dim() == 2:
                return cpu_fused.silu_mul(gate_up, out_dtype)
            return cpu_fused.silu_mul(gate_up.reshape(-1, gate_up.shape[-1]), out_dtype).view(
                *gate_up.shape[:-1], gate_up.shape[-1] // 2)
        return silu_and_mul(gate_up.float()).to(out_dtype)
    if runs_triton(gate_up):
        return activation.silu_and_mul_triton(gate_up)
    if cpu_fused.is_enabled() and cpu_fused.fits(gate_up) and gate_up.is_contiguous() \
            and not is_batch_invariant():
        return cpu_fused.silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(
            *gate_up.shape[:-1], gate_up.shape[-1] // 2)
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate) * up


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU; batch invariant on CPU when that mode is on (torch's silu is not, see
    kernels.batch_invariant)."""
    if is_batch_invariant() and not x.is_cuda:
        return bi.bi_silu(x)
    return torch.nn.functional.silu(x)


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
              w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts, `sum_j weight[t, j] * expert[ids[t, j]](x[t])` (weights None:
    1); see kernels.fused_moe. CUDA: the grouped-GEMM triton kernels, no host sync. CPU:
    the torch reference (the engine's CPU path is engine.models.moe.run_experts)."""
    if runs_triton(x):
        return _fused_moe.fused_moe_triton(x, topk_ids, topk_weights, w13, w2)
    return _fused_moe.fused_moe_ref(x, topk_ids, topk_weights, w13, w2)


def concat_weights(weights: list) -> torch.Tensor | QuantWeight:
    """Stack `[N_i, K]` weights along N (fused projections), quantized or not; parts of
    different quantized types stay apart inside one `quant.FusedWeight`."""
    if any(isinstance(w, QuantWeight) for w in weights):
        return fuse(weights)
    return torch.cat(weights)


def embedding(input_ids: torch.Tensor, table: torch.Tensor | QuantEmbedding) -> torch.Tensor:
    """Rows of an embedding table `[vocab, hidden]`, dequantized if it is quantized (a
    QuantEmbedding or a GGUF file's own blocks, kernels.gguf_weight)."""
    if not isinstance(table, torch.Tensor):
        return table.lookup(input_ids)
    return torch.nn.functional.embedding(input_ids, table)

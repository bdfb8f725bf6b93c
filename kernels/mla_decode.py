"""Multi-head latent attention (MLA) over the paged latent cache: the torch reference and a
split-KV decode kernel for the GPU.

The cache holds each token's latent `[c_kv | k_pe]` (D = rank + rope dims) as one kv head of
width D / 2 over the runner's two planes (engine/models/deepseek_v3.py):

    k plane  [num_blocks, block_size, 1, D / 2] = latent[:D/2]
    v plane  [num_blocks, block_size, 1, D / 2] = latent[D/2:]

Queries are already absorbed into latent space, q [T, heads, D]. Scores are q . latent over
all D dims, and the output is probs @ latent[:rank]: the whole k plane and the first
rank - D/2 dims of the v plane (rank >= D/2, since rank > the rope dims).

    mla_attend_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, rank, max_len)
        q [B, Q, heads, D], the last Q positions of each of B sequences -> [B, Q, heads, rank]
    mla_decode_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                      rank, max_seq_len, out)
        the one-query rows of a varlen step written into out [T, heads, rank]

The kernel is kernels.decode_attention's split-KV scheme: program (sequence, head block,
split) runs an online softmax over the split's keys, and that module's combine kernel merges
the splits in order. Every head of a sequence reads the same latent tile, so a program takes
BLOCK_H heads against one tile (the whole GQA group is every head). The split size is an
absolute constant, so a row's result does not depend on the batch.
"""
from __future__ import annotations

import torch

from duplex.kernels._triton import require_triton, tl, triton
from duplex.kernels.attention import attention_mask, gather_kv
from duplex.kernels.decode_attention import BLOCK_N, SPLIT_SIZE, _combine_kernel, split_partials

BLOCK_H = 16  # query heads per program (tl.dot needs >= 16 rows)


def mla_attend_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, rank: int,
                   max_len: int | None = None) -> torch.Tensor:
    """q [B, Q, heads, D]: the last Q positions of each of B sequences -> [B, Q, heads, rank],
    in q's dtype; the math in fp32. `max_len`: the longest sequence, a host number (read from
    seq_lens when None: a device sync)."""
    batch, num_q, heads, dim = q.shape
    if max_len is None:
        max_len = int(seq_lens.max())
    latent = torch.cat([gather_kv(k_cache, block_tables, max_len),
                        gather_kv(v_cache, block_tables, max_len)], dim=-1)[:, :, 0].float()
    # [B, L, D], fp32 whatever the cache's dtype
    # positions past a sequence's end hold stale blocks: zero them (0 * NaN is NaN)
    positions = torch.arange(latent.shape[1], device=latent.device)
    latent = latent.masked_fill((positions >= seq_lens[:, None])[:, :, None], 0.0)
    q_pos = seq_lens[:, None] - num_q + torch.arange(num_q, device=seq_lens.device)  # [B, Q]
    blocked = ~attention_mask(q_pos, latent.shape[1], None)  # [B, Q, L]
    scores = torch.bmm(q.float().view(batch, num_q * heads, dim), latent.transpose(1, 2))
    scores = (scores * scale).view(batch, num_q, heads, -1)
    scores.masked_fill_(blocked[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, num_q * heads, -1)
    out = torch.bmm(probs, latent[:, :, :rank])  # [B, Q * heads, rank]
    return out.view(batch, num_q, heads, rank).to(q.dtype)


@triton.jit
def _mla_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, m_ptr, l_ptr, acc_ptr, block_tables_ptr,
        query_start_loc_ptr, seq_lens_ptr, scale, stride_q_token, stride_q_head,
        stride_cache_block, stride_cache_slot, stride_block_table, block_size, num_heads,
        max_splits, HALF: tl.constexpr, RANK: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        FP32_DOT: tl.constexpr):
    """Program (sequence, head block, split): online softmax of BLOCK_H heads over the split's
    latent keys. Partials as kernels.decode_attention's, acc of width RANK. An idle program
    (not a decode row, or a split past the end) writes nothing."""
    seq = tl.program_id(0)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, seq_len)
    # integer compare rather than a scalar bool, which the interpreter mistypes
    num_rows = tl.where((q_len == 1) & (hi > lo), num_heads, 0)
    end = tl.where(num_rows > 0, hi, lo)

    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = head < num_rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HALF
    value_b = dims < RANK - HALF  # the v plane's dims that are values (the rest: k_pe)
    q_rows = q_ptr + q_start * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_a = tl.load(q_rows, mask=q_mask, other=0.0)  # [BLOCK_H, D/2] against the k plane
    q_b = tl.load(q_rows + HALF, mask=q_mask, other=0.0)  # against the v plane

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc_b = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(lo, end, BLOCK_N):
        k_pos = tile + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(block_tables_ptr + seq * stride_block_table + k_pos // block_size,
                        mask=k_ok, other=0)
        slot = block.to(tl.int64) * stride_cache_block + (k_pos % block_size) * stride_cache_slot
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        a = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(q_a.dtype)  # [BLOCK_N, D/2]
        b = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(q_a.dtype)
        if FP32_DOT:
            s = (tl.dot(q_a, tl.trans(a), input_precision="ieee")
                 + tl.dot(q_b, tl.trans(b), input_precision="ieee"))
        else:
            s = tl.dot(q_a, tl.trans(a)) + tl.dot(q_b, tl.trans(b))
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        b_values = tl.where(value_b[None, :], b, 0.0)
        if FP32_DOT:
            pa = tl.dot(p, a, input_precision="ieee")
            pb = tl.dot(p, b_values, input_precision="ieee")
        else:
            pa = tl.dot(p.to(a.dtype), a)
            pb = tl.dot(p.to(a.dtype), b_values)
        acc_a = acc_a * alpha[:, None] + pa
        acc_b = acc_b * alpha[:, None] + pb
        m_i = m_new
    part = (seq * num_heads + head) * max_splits + split  # [BLOCK_H]
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    acc_rows = acc_ptr + part[:, None] * RANK + dims[None, :]
    tl.store(acc_rows, acc_a, mask=q_mask)
    tl.store(acc_rows + HALF, acc_b, mask=row_ok[:, None] & value_b[None, :])


def mla_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, rank: int,
                      max_seq_len: int | None = None, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Triton launcher: q [T, heads, D] (varlen rows, `kernels.attention` conventions for the
    batch) -> out [T, heads, rank] with the rows of one-query sequences written (a new tensor
    when None; other rows then hold garbage). Pass `max_seq_len` (a host number) to avoid a
    device sync."""
    require_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    num_tokens, num_heads, dim = q.shape
    half = k_cache.shape[-1]
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == 1 and dim == 2 * half, (
        f"latent planes [blocks, block_size, 1, D/2] for q's D {dim}, got {k_cache.shape}")
    assert half <= rank <= dim, f"rank {rank} must lie in [D/2, D] = [{half}, {dim}]"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.dtype != torch.int8, (
        "MLA latent caches are float: an int8 KV pool is refused when the model loads")
    assert q.stride(2) == 1 and block_tables.stride(1) == 1
    if out is None:
        out = q.new_empty(num_tokens, num_heads, rank)
    assert out.shape == (num_tokens, num_heads, rank) and out.dtype == q.dtype
    assert out.stride(2) == 1, "out's last dim must be contiguous"
    num_seqs = block_tables.shape[0]
    parts = split_partials(num_seqs, num_heads, rank, seq_lens, max_seq_len)
    if parts is None:
        return out
    max_splits, m, l, acc = parts  # noqa: E741
    _mla_split_kernel[(num_seqs, triton.cdiv(num_heads, BLOCK_H), max_splits)](
        q, k_cache, v_cache, m, l, acc, block_tables, query_start_loc, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        k_cache.shape[1], num_heads, max_splits, HALF=half, RANK=rank, SPLIT=SPLIT_SIZE,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(half)),
        FP32_DOT=q.dtype == torch.float32)
    _combine_kernel[(num_seqs, num_heads)](
        m, l, acc, out, query_start_loc, seq_lens, 0, out.stride(0), out.stride(1), num_heads,
        max_splits, HEAD_DIM=rank, SPLIT=SPLIT_SIZE,
        BLOCK_D=max(16, triton.next_power_of_2(rank)), HAS_WINDOW=False)
    return out

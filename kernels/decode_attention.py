"""Split-KV ("flash-decoding") paged attention for the decode rows of a step.

Same inputs and masking rules as kernels.attention (varlen q, block-table KV cache, GQA,
sliding window, soft cap), but only sequences with exactly one query are computed; the
rows of every other sequence are left as they are in `out`. The torch reference is
`kernels.attention.paged_attention_ref` (restricted to those rows).

A long context gives one program too little work, so each sequence's keys are cut into
splits of `SPLIT_SIZE` positions at absolute offsets:

    split s of a sequence covers key positions [s * SPLIT_SIZE, (s + 1) * SPLIT_SIZE)

    kernel 1, program (seq, kv head, split): the GROUP query heads of that kv head as one
        tile against the split's keys -> partial max m, sum l, unnormalised acc (fp32)
    kernel 2, program (seq, head): the splits combined one after another, in split order

The split size is a constant, not derived from the batch, and the tiles inside a split sit
at absolute positions: a row's result depends only on its own sequence, whatever else is in
the batch (batch-invariant mode stays bitwise on a GPU).
"""
from typing import NamedTuple

import torch

from duplex.kernels._triton import require_triton, tl, triton
from duplex.kernels.attention import (check_inputs, kv_tile_scores, online_softmax_step,
                               paged_attention_triton)

SPLIT_SIZE = 256  # key positions per split; a constant so that results are batch invariant
BLOCK_N = 64  # key positions per tile inside a split (divides SPLIT_SIZE)


class StepLens(NamedTuple):
    """Host numbers of a step that pick and size the GPU attention launches (no sync)."""
    max_query_len: int
    max_seq_len: int
    has_decode: bool  # some sequence has exactly one query

    @classmethod
    def of(cls, query_lens: list[int], seq_lens: list[int]) -> "StepLens":
        return cls(max(query_lens, default=0), max(seq_lens, default=0), 1 in query_lens)


def paged_attention_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, lens: StepLens,
                          sliding_window: int | None = None,
                          soft_cap: float | None = None) -> torch.Tensor:
    """The whole step on a GPU: multi-query sequences through kernels.attention's kernel,
    one-query sequences through the split-KV kernels (always, so that a decode row's result
    does not depend on whether a prefill shares its step)."""
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window, soft_cap)
    out = None
    if lens.max_query_len > 1 or not lens.has_decode:
        out = paged_attention_triton(*args, max_query_len=lens.max_query_len,
                                     skip_decode=lens.has_decode)
    if not lens.has_decode:
        return out
    return decode_attention_triton(*args, max_seq_len=lens.max_seq_len, out=out)


@triton.jit
def _split_kv_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, m_ptr, l_ptr, acc_ptr, block_tables_ptr,
        query_start_loc_ptr, seq_lens_ptr, scale, soft_cap, sliding_window, stride_q_token,
        stride_q_head, stride_cache_block, stride_cache_slot, stride_cache_head,
        stride_block_table, block_size, num_heads, max_splits,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, FP32_DOT: tl.constexpr,
        INT8_KV: tl.constexpr):
    """Program (sequence, kv head, split): online softmax of the group's heads over the
    split's visible keys. A program with nothing to do (not a decode row, split past the end
    or before the window) writes nothing; the combine kernel never reads its slot."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0  # first visible key position (the query sits at seq_len - 1)
    if HAS_WINDOW:
        first = tl.maximum(0, seq_len - sliding_window)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, seq_len)
    # query heads this program computes: the group, or none (an idle program loads and
    # stores nothing; integer compare rather than a scalar bool, which the interpreter mistypes)
    num_rows = tl.where((q_len == 1) & (hi > tl.maximum(lo, first)), GROUP, 0)
    start = tl.maximum(lo, first // BLOCK_N * BLOCK_N)  # tiles stay at absolute positions
    end = tl.where(num_rows > 0, hi, start)

    g = tl.arange(0, BLOCK_G)
    row_ok = g < num_rows
    head = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + q_start * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        k_pos = tile + tl.arange(0, BLOCK_N)
        k_ok = (k_pos < hi) & (k_pos >= first)
        k, v, s = kv_tile_scores(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head,
                                 k_pos, k_ok, dims, dim_ok, scale, soft_cap, block_size,
                                 stride_block_table, stride_cache_block, stride_cache_slot,
                                 stride_cache_head, HAS_SOFT_CAP, FP32_DOT, HEAD_DIM, INT8_KV)
        s = tl.where(k_ok[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, FP32_DOT)
    part = (seq * num_heads + head) * max_splits + split  # [BLOCK_G]
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr,
                    sliding_window, stride_o_token, stride_o_head, num_heads, max_splits,
                    HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_WINDOW: tl.constexpr):
    """Program (sequence, head): merge the non-empty splits in split order (a sequential
    loop, so the result never depends on how many splits other sequences have)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(0, seq_len - sliding_window)
    s_lo = first // SPLIT  # every split from here to the end holds a visible key
    s_hi = tl.where(q_len == 1, tl.cdiv(seq_len, SPLIT), s_lo)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    store_ok = dims < tl.where(q_len == 1, HEAD_DIM, 0)
    base = (seq * num_heads + head) * max_splits
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(s_lo, s_hi):
        m_s = tl.load(m_ptr + base + s)
        l_s = tl.load(l_ptr + base + s)
        acc_s = tl.load(acc_ptr + (base + s) * HEAD_DIM + dims, mask=dim_ok, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_s - m_new)
        l = l * alpha + l_s * beta  # noqa: E741
        acc = acc * alpha + acc_s * beta
        m = m_new
    out = acc / tl.where(s_hi > s_lo, l, 1.0)
    tl.store(out_ptr + q_start * stride_o_token + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=store_ok)


def split_partials(num_seqs: int, num_heads: int, width: int, seq_lens: torch.Tensor,
                   max_seq_len: int | None, split_size: int = SPLIT_SIZE):
    """The split kernels' fp32 partials: (max_splits, m, l [num_seqs, num_heads, max_splits],
    acc [..., width]); None when there is nothing to compute. max_seq_len None: read from
    seq_lens (a device sync)."""
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    max_splits = triton.cdiv(max_seq_len, split_size)
    if num_seqs == 0 or max_splits == 0:
        return None
    m = torch.empty((num_seqs, num_heads, max_splits), dtype=torch.float32,
                    device=seq_lens.device)
    acc = torch.empty((num_seqs, num_heads, max_splits, width), dtype=torch.float32,
                      device=seq_lens.device)
    return max_splits, m, torch.empty_like(m), acc


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            max_seq_len: int | None = None, out: torch.Tensor | None = None,
                            split_size: int = SPLIT_SIZE, block_n: int = BLOCK_N
                            ) -> torch.Tensor:
    """Triton launcher: the rows of one-query sequences written into `out` (a new tensor
    when None; other rows then hold garbage). Same conventions as
    `kernels.attention.paged_attention_ref`. Pass `max_seq_len` (host number) to avoid a
    device sync; keep split_size/block_n at their defaults wherever results must match
    across batches."""
    check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    require_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be the contiguous dim"
    assert k_cache.dtype == v_cache.dtype, (
        f"k_cache and v_cache must share a dtype, got {k_cache.dtype}, {v_cache.dtype}")
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert split_size % block_n == 0 and block_n >= 16, (
        f"split_size {split_size} must be a multiple of block_n {block_n} (>= 16)")
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, (
        "out must be shaped and typed like q, head_dim contiguous")
    num_seqs, num_heads, head_dim = block_tables.shape[0], q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    parts = split_partials(num_seqs, num_heads, head_dim, seq_lens, max_seq_len, split_size)
    if parts is None:
        return out
    max_splits, m, l, acc = parts  # noqa: E741
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    has_window = sliding_window is not None
    _split_kv_kernel[(num_seqs, num_kv_heads, max_splits)](
        q, k_cache, v_cache, m, l, acc, block_tables, query_start_loc, seq_lens, scale,
        1.0 if soft_cap is None else float(soft_cap),
        0 if sliding_window is None else int(sliding_window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), k_cache.shape[1], num_heads, max_splits,
        GROUP=group, HEAD_DIM=head_dim, SPLIT=split_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=has_window, HAS_SOFT_CAP=soft_cap is not None,
        FP32_DOT=q.dtype == torch.float32, INT8_KV=k_cache.dtype == torch.int8)
    _combine_kernel[(num_seqs, num_heads)](
        m, l, acc, out, query_start_loc, seq_lens,
        0 if sliding_window is None else int(sliding_window), out.stride(0), out.stride(1),
        num_heads, max_splits, HEAD_DIM=head_dim, SPLIT=split_size, BLOCK_D=block_d,
        HAS_WINDOW=has_window)
    return out

"""Paged attention over a block-table KV cache, for decode and for prefill over a cached prefix.

Inputs are flattened over sequences (varlen):

    q                [num_tokens, num_heads, head_dim]   sequence i owns rows
                                                          query_start_loc[i] : query_start_loc[i+1]
    k_cache/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables     int32 [num_seqs, max_blocks_per_seq]  position p of seq i lives in block
                                                          block_tables[i, p // block_size]
    query_start_loc  int32 [num_seqs + 1]                  cumulative query lengths
    seq_lens         int32 [num_seqs]                      context length INCLUDING the new tokens

The queries of sequence i are its last q_len_i positions: query j sits at position
`seq_len_i - q_len_i + j` and sees keys at positions `p` with

    p <= query position                                  (causal)
    p >  query position - sliding_window                 (when sliding_window is set)

which is transformers' `sliding_window_overlay` (`kv_idx > q_idx - sliding_window`): a query
sees itself and the `sliding_window - 1` positions before it. Head h reads kv head
`h // (num_heads // num_kv_heads)` (GQA). `soft_cap` applies `cap * tanh(logits / cap)` to the
scaled logits before masking (Gemma 2). Math is fp32; the output has q's dtype.
"""
from typing import NamedTuple

import numpy as np
import torch

from duplex.kernels import cpu_attention, cpu_fused
from duplex.kernels.kv_store import cache_head_dim, dequantize_rows, load_int8_rows
from duplex.kernels._triton import require_triton, tl, triton


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None) -> torch.Tensor:
    """Torch reference: decode sequences (q_len == 1) in one padded batch, others one by one."""
    check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:])]
    decode_ids = [i for i, n in enumerate(q_lens) if n == 1]
    if decode_ids:
        rows = torch.tensor([starts[i] for i in decode_ids], device=q.device)
        seqs = torch.tensor(decode_ids, device=q.device)
        out[rows] = _attend_decode(q[rows], k_cache, v_cache, block_tables[seqs],
                                   seq_lens[seqs], scale, sliding_window, soft_cap)
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            s = starts[i]
            out[s:s + q_len] = _attend_one(q[s:s + q_len], k_cache, v_cache, block_tables[i],
                                           lens[i], scale, sliding_window, soft_cap)
    return out


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_positions: int) -> torch.Tensor:
    """fp32 `[B, L, num_kv_heads, head_dim]` copy of the blocks holding the first
    `num_positions` positions of each row of `block_tables [B, *]` (an int8 cache's rows
    dequantized); L is `num_positions` rounded up to whole blocks. Positions past a
    sequence's length hold whatever the cache (or the block-table padding) points at:
    callers mask them."""
    block_size = cache.shape[1]
    num_blocks = -(-num_positions // block_size)
    blocks = block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)
    # index_select of whole blocks as rows is several times faster than cache[blocks]
    rows = cache.reshape(cache.shape[0], -1).index_select(0, blocks.flatten())
    return dequantize_rows(rows.view(blocks.shape[0], blocks.shape[1] * block_size,
                                     *cache.shape[2:]))


def attention_mask(q_pos: torch.Tensor, num_positions: int,
                   sliding_window: int | None) -> torch.Tensor:
    """Bool `[..., Q, L]`: True where a query at `q_pos [..., Q]` may see key position l < L."""
    k_pos = torch.arange(num_positions, device=q_pos.device)
    allowed = k_pos <= q_pos[..., None]
    if sliding_window is not None:
        allowed &= k_pos > q_pos[..., None] - sliding_window
    return allowed


def _attend_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, soft_cap):
    """One query per sequence; q `[B, num_heads, head_dim]`."""
    q_pos = (seq_lens.long() - 1)[:, None]  # [B, 1]
    return _attend_paged(q[:, None], q_pos, k_cache, v_cache, block_tables, seq_lens.long(),
                         scale, sliding_window, soft_cap)[:, 0]


def _attend_one(q, k_cache, v_cache, block_table, seq_len, scale, sliding_window, soft_cap):
    """All q_len queries of one sequence; q `[q_len, num_heads, head_dim]`."""
    q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)[None]  # [1, Q]
    seq_lens = torch.tensor([seq_len], device=q.device)
    return _attend_paged(q[None], q_pos, k_cache, v_cache, block_table[None], seq_lens,
                         scale, sliding_window, soft_cap)[0]


def _attend_paged(q, q_pos, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                  soft_cap):
    """q `[B, Q, H, D]` at positions `q_pos [B, Q]` -> `[B, Q, H, D]`."""
    max_len = int(seq_lens.max())
    k = gather_kv(k_cache, block_tables, max_len)  # [B, L, KVH, D]
    v = gather_kv(v_cache, block_tables, max_len)
    past_end = torch.arange(k.shape[1], device=q.device) >= seq_lens[:, None]  # [B, L]
    # masked keys get probability 0, but 0 * garbage (NaN in a fresh cache) is still NaN, and
    # a fused kernel adds the mask to the score, so NaN keys must go too
    padding = past_end.nonzero(as_tuple=True)
    k[padding] = 0.0
    v[padding] = 0.0
    mask = attention_mask(q_pos, k.shape[1], sliding_window)  # [B, Q, L]
    return _attend(q, k, v, mask, scale, soft_cap)


def _attend(q, k, v, mask, scale, soft_cap, causal=False):
    """q `[B, Q, H, D]`, k/v `[B, L, KVH, D]`, mask `[B, Q, L]` (None: every key seen; causal,
    with Q == L and no soft cap: query i sees keys up to i) -> `[B, Q, H, D]` in q.dtype; the
    math in fp32. The causal flag gives the mask's bits: a masked key adds exactly nothing to
    the fused kernel's running sums, so skipping its block changes no bit (tested).

    Without a soft cap: torch's fused CPU attention (scaled_dot_product_attention, grouped
    query heads), on strided views — 1.5-1.8x faster than matmul + softmax on small decode
    batches. With one: one batched matmul per kv head."""
    k, v = k.float(), v.float()
    if soft_cap is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if mask is None else mask[:, None], scale=scale,
            is_causal=causal, enable_gqa=True)  # [B, H, Q, D]
        return out.transpose(1, 2).to(q.dtype)
    if mask is None:
        mask = torch.ones(q.shape[0], q.shape[1], k.shape[1], dtype=torch.bool)
    B, Q, H, D = q.shape
    kv_heads = k.shape[2]
    group = H // kv_heads
    # rows of one (sequence, kv head): (head in group, query) -> [B, KVH, G*Q, D]
    qf = q.float().view(B, Q, kv_heads, group, D).permute(0, 2, 3, 1, 4).reshape(
        B, kv_heads, group * Q, D)
    out = torch.empty_like(qf)
    blocked = ~mask[:, None]  # [B, 1, Q, L], broadcast over the group
    for h in range(kv_heads):
        scores = torch.bmm(qf[:, h], k[:, :, h].transpose(1, 2)) * scale  # [B, G*Q, L]
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        scores = scores.view(B, group, Q, -1).masked_fill_(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(B, group * Q, -1)
        torch.bmm(probs, v[:, :, h], out=out[:, h])  # [B, G*Q, D]
    out = out.view(B, kv_heads, group, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, H, D)
    return out.to(q.dtype)


class PrefillPlan(NamedTuple):
    """One sequence with several queries: its rows, the cache slots of the keys it may see
    and, when some query must not see some key, the mask."""
    start: int  # first row in q
    num_queries: int
    keys: torch.Tensor  # int64 [L]: cache slot of key j (positions first .. seq_len - 1)
    mask: torch.Tensor | None  # bool [1, Q, L]; None: every query sees every key
    span: slice | None = None  # the same slots when they are consecutive: a view, no copy
    causal: bool = False  # mask is exactly "key j <= query i" over all its keys (no prefix, no
    #                       window): the fused kernel's own causal mask, which skips the key
    #                       blocks above the diagonal (half a long prompt's attention)
    unwindowed: bool = False  # keys are positions 0 .. L - 1 and query i (position L - Q + i)
    #                           sees those up to it: what the C prompt kernel computes


class AttentionPlan(NamedTuple):
    """A step's attention index work, built once on the host from numbers the scheduler
    already has and shared by every layer of one KV group (see `plan_attention`).

    Keys are gathered by slot, and only those inside the window, so a single decode
    sequence needs no mask at all; padded key columns repeat the last valid slot (finite
    data) and are masked."""
    decode_rows: torch.Tensor | None  # int64 [B]: q rows of the one-query sequences; None:
    #                                   every row, in order
    decode_keys: torch.Tensor | None  # int64 [B, L]: cache slots; None: no such sequence
    decode_mask: torch.Tensor | None  # bool [B, 1, L]; None: no padding
    prefills: tuple[PrefillPlan, ...]
    decode_span: slice | None = None  # one sequence whose slots are consecutive: a view
    decode_counts: torch.Tensor | None = None  # int64 [B]: keys each decode query sees


def plan_attention(block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                   block_size: int, sliding_window: int | None = None) -> AttentionPlan:
    """The plan for `block_tables [S, M]` (host tensor) and host lists of query and context
    lengths (context includes the new tokens), under the module's masking rules."""
    table = block_tables.numpy()
    window = sliding_window or 0
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    starts = np.cumsum([0] + query_lens[:-1]).tolist()
    prefills = tuple(_plan_prefill(table[i], starts[i], query_lens[i], seq_lens[i], block_size,
                                   window) for i, n in enumerate(query_lens) if n > 1)
    if not decode:
        return AttentionPlan(None, None, None, prefills)
    lens = np.asarray([seq_lens[i] for i in decode])
    seen = np.minimum(lens, window) if window else lens  # keys each query may see
    cols = np.arange(int(seen.max()))
    pos = (lens - seen)[:, None] + np.minimum(cols[None, :], seen[:, None] - 1)  # [B, L]
    slots = _slots(table[decode], pos, block_size)
    mask = None if bool((seen == seen[0]).all()) else \
        torch.from_numpy(cols[None, :] < seen[:, None])[:, None]  # [B, 1, L]
    rows = None if len(decode) == len(query_lens) else torch.tensor(starts, dtype=torch.long)[decode]
    span = _span(slots[0]) if len(decode) == 1 else None
    return AttentionPlan(rows, torch.from_numpy(slots), mask, prefills, span,
                         torch.from_numpy(seen.astype(np.int64)))


def _span(slots: np.ndarray) -> slice | None:
    """slots [L] as a slice when they are consecutive (a request's blocks usually are)."""
    first = int(slots[0])
    if int(slots[-1]) - first == len(slots) - 1 and bool((np.diff(slots) == 1).all()):
        return slice(first, first + len(slots))
    return None


def _plan_prefill(table_row, start: int, q_len: int, seq_len: int, block_size: int,
                  window: int) -> PrefillPlan:
    first_query = seq_len - q_len
    first_key = max(0, first_query - window + 1) if window else 0
    key_pos = np.arange(first_key, seq_len)  # [L]
    q_pos = np.arange(first_query, seq_len)[:, None]  # [Q, 1]
    allowed = key_pos[None, :] <= q_pos
    if window:
        allowed &= key_pos[None, :] > q_pos - window
    slots = _slots(table_row[None], key_pos[None], block_size)[0]
    return PrefillPlan(start, q_len, torch.from_numpy(slots), torch.from_numpy(allowed)[None],
                       _span(slots), causal=first_query == 0 and not window,
                       unwindowed=not window)


def _slots(table: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of positions `pos [B, L]` of the sequences whose block tables are `table`."""
    blocks = np.take_along_axis(table, pos // block_size, axis=1).astype(np.int64)
    return blocks * block_size + pos % block_size


def paged_attention_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            plan: AttentionPlan, scale: float,
                            soft_cap: float | None = None) -> torch.Tensor:
    """The reference's result (same conventions) from a prebuilt plan: per layer, only the
    key gathers and the attention itself run (an int8 cache's gathered rows dequantized;
    the C decode and prompt kernels take float caches only, cpu_attention.fits; the prompt
    one, AVX512 or AVX2, sequences without a window)."""
    num_kv_heads, width = k_cache.shape[2:]
    head_dim = cache_head_dim(k_cache)
    k_slots = k_cache.view(-1, num_kv_heads, width)  # [num_slots, KVH, row]
    v_slots = v_cache.view(-1, num_kv_heads, width)
    decode_out = None
    if plan.decode_keys is not None and plan.decode_counts is not None \
            and cpu_fused.is_enabled() and cpu_attention.available() \
            and cpu_attention.fits(q, k_cache, soft_cap):
        decode_out = cpu_attention.decode(q, k_cache, v_cache, plan.decode_rows,
                                          plan.decode_keys, plan.decode_counts, scale).to(q.dtype)
        if plan.decode_rows is None:
            return decode_out
    elif plan.decode_keys is not None:
        num_seqs, num_keys = plan.decode_keys.shape
        k = _gather(k_slots, plan.decode_keys.view(-1), plan.decode_span).view(
            num_seqs, num_keys, num_kv_heads, head_dim)
        v = _gather(v_slots, plan.decode_keys.view(-1), plan.decode_span).view(
            num_seqs, num_keys, num_kv_heads, head_dim)
        qd = q if plan.decode_rows is None else q.index_select(0, plan.decode_rows)
        decode_out = _attend(qd[:, None], k, v, plan.decode_mask, scale, soft_cap)[:, 0]
        if plan.decode_rows is None:
            return decode_out
    out = torch.empty_like(q)
    if decode_out is not None:
        out[plan.decode_rows] = decode_out
    in_c = plan.prefills and soft_cap is None and cpu_fused.is_enabled() \
        and cpu_attention.prefill_available() and cpu_attention.fits(q, k_cache, soft_cap) \
        and out.stride(1) == out.shape[2] and out.stride(2) == 1
    for p in plan.prefills:
        rows = slice(p.start, p.start + p.num_queries)
        if in_c and p.unwindowed:
            cpu_attention.prefill(q[rows], k_cache, v_cache, p.keys, scale, out[rows])
            continue
        k = _gather(k_slots, p.keys, p.span)[None]  # [1, L, KVH, D]
        v = _gather(v_slots, p.keys, p.span)[None]
        causal = p.causal and soft_cap is None
        out[rows] = _attend(q[None, rows], k, v, None if causal else p.mask, scale, soft_cap,
                            causal)[0]
    return out


def _gather(slots: torch.Tensor, keys: torch.Tensor, span: slice | None) -> torch.Tensor:
    """Rows `keys` of `slots [num_slots, KVH, row]` as `[len(keys), KVH, D]`: a view when
    they are one span of a float32 cache, else an fp32 copy (dequantized from int8)."""
    return dequantize_rows(slots[span] if span is not None else slots.index_select(0, keys))


def check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    """Plain-words asserts shared by the reference and the triton launcher."""
    assert q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert cache_head_dim(k_cache) == head_dim, (
        f"cache head_dim {cache_head_dim(k_cache)} ({k_cache.dtype}) != q's {head_dim}")
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, (
        f"block_tables must be int32 [num_seqs, max_blocks_per_seq], got {block_tables.dtype} "
        f"{tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,), (
        f"query_start_loc must be int32 [num_seqs + 1 = {num_seqs + 1}], got "
        f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,), (
        f"seq_lens must be int32 [num_seqs = {num_seqs}], got {seq_lens.dtype} "
        f"{tuple(seq_lens.shape)}")
    assert q.device == k_cache.device == block_tables.device == seq_lens.device, (
        "q, caches, block_tables, query_start_loc and seq_lens must be on one device")


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr,
        seq_lens_ptr, scale, soft_cap, sliding_window, stride_q_token, stride_q_head,
        stride_o_token, stride_o_head, stride_cache_block, stride_cache_slot,
        stride_cache_head, stride_block_table, block_size,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFT_CAP: tl.constexpr, FP32_DOT: tl.constexpr, SKIP_DECODE: tl.constexpr,
        INT8_KV: tl.constexpr):
    """Program (sequence, kv head, row tile). A row is a (query, head in the kv head's group)
    pair, so decode (one query, GROUP heads) and prefill share the kernel and a kv tile is
    loaded once for the whole group. Online softmax over key tiles of BLOCK_N positions,
    each position looked up through the block table. SKIP_DECODE: one-query sequences are
    left to kernels.decode_attention (their rows are neither read nor written)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if SKIP_DECODE:
        q_len = tl.where(q_len == 1, 0, q_len)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUP
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = seq_len - q_len + q_idx  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_q_token
                + head[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # key range that any row of this tile can see
    first_q = seq_len - q_len + (tl.program_id(2) * BLOCK_M) // GROUP
    hi = tl.minimum(seq_len, seq_len - q_len + tl.max(tl.where(row_ok, q_idx, 0)) + 1)
    hi = tl.where(tl.sum(row_ok.to(tl.int32)) > 0, hi, 0)  # a tile past q_len does nothing
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_q - sliding_window + 1) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < seq_len
        k, v, s = kv_tile_scores(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head,
                                 k_pos, k_ok, dims, dim_ok, scale, soft_cap, block_size,
                                 stride_block_table, stride_cache_block, stride_cache_slot,
                                 stride_cache_head, HAS_SOFT_CAP, FP32_DOT, HEAD_DIM, INT8_KV)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, FP32_DOT)
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows have l_i == 0
    tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_o_token
             + head[:, None] * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def kv_tile_scores(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, k_pos, k_ok,
                   dims, dim_ok, scale, soft_cap, block_size, stride_block_table,
                   stride_cache_block, stride_cache_slot, stride_cache_head,
                   HAS_SOFT_CAP: tl.constexpr, FP32_DOT: tl.constexpr,
                   HEAD_DIM: tl.constexpr, INT8_KV: tl.constexpr):
    """One tile of a sequence's paged keys and values at positions k_pos (k_ok: inside the
    sequence) and the scaled, soft-capped scores of q against them: (k, v, s). INT8_KV: the
    cache holds packed int8 rows (kernels.kv_store), dequantized here."""
    block = tl.load(block_tables_ptr + seq * stride_block_table + k_pos // block_size,
                    mask=k_ok, other=0)
    slot_off = (block.to(tl.int64) * stride_cache_block
                + (k_pos % block_size) * stride_cache_slot + kv_head * stride_cache_head)
    kv_mask = k_ok[:, None] & dim_ok[None, :]
    # a cache of another dtype than q (bf16 KV beside fp32 activations) is read as q's
    if INT8_KV:
        k = load_int8_rows(k_cache_ptr, slot_off, dims, kv_mask, k_ok, HEAD_DIM).to(q.dtype)
        v = load_int8_rows(v_cache_ptr, slot_off, dims, kv_mask, k_ok, HEAD_DIM).to(q.dtype)
    else:
        k = tl.load(k_cache_ptr + slot_off[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + slot_off[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if HAS_SOFT_CAP:
        s = soft_cap * tanh(s / soft_cap)
    return k, v, s


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, FP32_DOT: tl.constexpr):
    """Fold one tile of masked scores s [rows, keys] and values v [keys, D] into the running
    max m_i, sum l_i and output acc (rows with nothing visible yet keep m_i = -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP32_DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def tanh(x):
    """tanh from exp (no libdevice needed, interpreter-safe); exact limits at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           max_query_len: int | None = None, block_m: int = 64,
                           block_n: int = 64, skip_decode: bool = False) -> torch.Tensor:
    """Triton launcher; same contract as `paged_attention_ref`. Pass `max_query_len` to avoid
    a device sync; block_m/block_n are tile sizes (powers of two, >= 16). `skip_decode`:
    the rows of one-query sequences are left unwritten (the split-KV decode kernel's)."""
    check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    require_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be the contiguous dim"
    assert k_cache.dtype == v_cache.dtype, (
        f"k_cache and v_cache must share a dtype, got {k_cache.dtype}, {v_cache.dtype}")
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    num_seqs = block_tables.shape[0]
    group = q.shape[1] // k_cache.shape[2]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    out = torch.empty_like(q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (num_seqs, k_cache.shape[2], triton.cdiv(max_query_len * group, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
        1.0 if soft_cap is None else float(soft_cap),
        0 if sliding_window is None else int(sliding_window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), k_cache.shape[1],
        GROUP=group, HEAD_DIM=q.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])),
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
        FP32_DOT=q.dtype == torch.float32, SKIP_DECODE=skip_decode,
        INT8_KV=k_cache.dtype == torch.int8)
    return out

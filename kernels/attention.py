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
import torch

from kernels._triton import require_triton, tl, triton


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
    `num_positions` positions of each row of `block_tables [B, *]`; L is `num_positions`
    rounded up to whole blocks. Positions past a sequence's length hold whatever the cache
    (or the block-table padding) points at: callers mask them."""
    block_size = cache.shape[1]
    num_blocks = -(-num_positions // block_size)
    blocks = block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)
    # index_select of whole blocks as rows is several times faster than cache[blocks]
    rows = cache.reshape(cache.shape[0], -1).index_select(0, blocks.flatten())
    return rows.view(blocks.shape[0], num_blocks * block_size, *cache.shape[2:]).float()


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
    # masked keys get probability 0, but 0 * garbage (NaN in a fresh cache) is still NaN
    v[past_end.nonzero(as_tuple=True)] = 0.0
    mask = attention_mask(q_pos, k.shape[1], sliding_window)  # [B, Q, L]
    return _attend(q, k, v, mask, scale, soft_cap)


def _attend(q, k, v, mask, scale, soft_cap):
    """q `[B, Q, H, D]`, k/v `[B, L, KVH, D]` fp32, mask `[B, Q, L]` -> `[B, Q, H, D]` in q.dtype.

    One batched matmul per kv head on strided views of k and v: no transposed copies."""
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


def check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    """Plain-words asserts shared by the reference and the triton launcher."""
    assert q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q's {head_dim}"
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

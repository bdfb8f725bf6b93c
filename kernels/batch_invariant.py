"""Batch-invariant mode: one process-wide switch, and CPU implementations whose result for a
row (a token) is bitwise the same whatever else is in the batch (DESIGN invariant 8).

Why plain torch is not enough on CPU, measured on this box (torch 2.13, MKL, AVX-512):
* `F.linear` rows differ between M = 1..3, 5..7, 9..11 and larger M (MKL picks other kernels
  for small M); `sum` over one long row differs from the same row in a batch (the lone row's
  reduction is split across threads); `sigmoid`/`silu` differ between vectorised and scalar
  tail elements, so an element's value depends on where the tensor's length puts it.
* What holds: exact IEEE ops (add, mul, div, max, where) are position-free; torch's exp, log,
  tanh and rsqrt agree between vector and tail paths; a GEMM of one fixed shape gives each row
  the same bits whatever the other rows are and wherever the row sits; `bmm` gives each batch
  item the same bits whatever the batch count (and with a stride-0 expanded operand).

So every op here is built from those: GEMMs only on fixed-shape tiles, sums as a fixed
pairwise tree of elementwise adds, attention as a fixed chunking of the key axis at absolute
positions with an online softmax whose per-row steps do not depend on who else is in the
batch. `tests/kernels/test_batch_invariant.py` asserts each invariant and reports where the
plain ops break it.
"""
import torch

from duplex.kernels import attention

_enabled = False


def is_batch_invariant() -> bool:
    return _enabled


class set_batch_invariant_mode:
    """Turn the mode on (or off) process-wide, now. Used as a context manager it restores the
    previous setting on exit: `with set_batch_invariant_mode(): ...`. Process-wide rather than
    thread-local because the engine runs its forward pass in an executor thread."""

    def __init__(self, enabled: bool = True):
        global _enabled
        self._previous = _enabled
        _enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        global _enabled
        _enabled = self._previous


# ---------------------------------------------------------------- reductions, activations

def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a fixed pairwise tree of elementwise adds: the order depends
    only on the row length. `[..., n] -> [...]`."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def bi_log_softmax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 log-softmax, batch invariant."""
    x = logits.float().movedim(dim, -1)
    shifted = x - x.amax(-1, keepdim=True)  # max is exact in any order
    out = shifted - torch.log(tree_sum(torch.exp(shifted)))[..., None]
    return out.movedim(-1, dim)


def bi_softmax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 softmax, batch invariant."""
    x = logits.float().movedim(dim, -1)
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return (e / tree_sum(e)[..., None]).movedim(-1, dim)


def bi_silu(x: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(x)` from exp, whose vector and tail paths agree (torch's silu's do not)."""
    return x / (1.0 + torch.exp(-x))


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, offset: float = 0.0):
    """`kernels.rms_norm.rms_norm_ref` semantics with a fixed-order mean of squares."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(tree_sum(h * h)[..., None] / h.shape[-1] + eps)
    out = (h * (offset + weight.float())).to(dtype) if offset else weight * h.to(dtype)
    return out if residual is None else (out, x)


# ---------------------------------------------------------------- matmul on fixed row tiles

# Every row goes through a GEMM of exactly one of these row counts. The largest is the bulk
# tile; smaller ones (cheaper for decode) are used only once a probe has shown, for the weight's
# shape and dtype, that they give every row the same bits as the bulk tile.
TILE_ROWS = (32, 8, 4)
_verified_tiles: dict[tuple, tuple[int, ...]] = {}


def bi_matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ w_t [K, N]`, each row computed inside a fixed-shape row tile."""
    assert x.dim() == 2 and w_t.dim() == 2 and x.shape[1] == w_t.shape[0], (
        f"x must be [M, K] and w_t [K, N], got {tuple(x.shape)} and {tuple(w_t.shape)}")
    tiles = _tiles_for(w_t)
    outs = [_tile_mm(x[start:start + rows], w_t, size) for start, rows, size in
            _plan_tiles(x.shape[0], tiles)]
    if not outs:
        return x.new_empty(0, w_t.shape[1])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def bi_linear(x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [..., K] @ weight [N, K].T + bias`, batch invariant (bias added elementwise)."""
    out = bi_matmul(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _plan_tiles(num_rows: int, tiles: tuple[int, ...]):
    """`(start, rows, tile_size)` covering num_rows: bulk tiles, then the smallest verified
    tile that holds the remainder."""
    bulk = tiles[0]
    plan = [(start, bulk, bulk) for start in range(0, num_rows - num_rows % bulk, bulk)]
    rest = num_rows % bulk
    if rest:
        size = min(t for t in tiles if t >= rest)
        plan.append((num_rows - rest, rest, size))
    return plan


def _tile_mm(rows: torch.Tensor, w_t: torch.Tensor, size: int) -> torch.Tensor:
    """`rows` zero-padded to a fresh (hence equally aligned) `[size, K]` tile, times w_t."""
    tile = rows.new_zeros(size, rows.shape[1])
    tile[:rows.shape[0]] = rows
    return torch.mm(tile, w_t)[:rows.shape[0]]


def _tiles_for(w_t: torch.Tensor) -> tuple[int, ...]:
    key = (tuple(w_t.shape), w_t.stride(), w_t.dtype)
    if key not in _verified_tiles:
        _verified_tiles[key] = _probe_tiles(w_t)
    return _verified_tiles[key]


def _probe_tiles(w_t: torch.Tensor) -> tuple[int, ...]:
    """Keep each smaller tile size whose rows, at every position, equal the bulk tile's."""
    bulk = TILE_ROWS[0]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(bulk, w_t.shape[0], generator=gen).to(w_t.dtype)
    expected = torch.mm(probe, w_t)
    kept = [bulk]
    for size in TILE_ROWS[1:]:
        if all(torch.equal(_tile_mm(probe[s:s + size], w_t, size), expected[s:s + size])
               for s in range(0, bulk, size)):
            kept.append(size)
    return tuple(kept)


# ---------------------------------------------------------------- paged attention

# Keys are processed in chunks at absolute positions [c * KV_CHUNK, (c + 1) * KV_CHUNK): the
# same chunks for a query whether it arrives in a prefill chunk or alone as decode.
KV_CHUNK = 128


def row_tile(group: int) -> int:
    """Query rows per GEMM item: the kv head's group rounded up to a multiple of 4 (MKL has
    separate, item-dependent kernels for fewer rows). Fixed per model, so decode (one token's
    group, padded) and prefill (tokens x group, cut in tiles) share item shapes."""
    return -(-group // 4) * 4


def bi_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                       soft_cap: float | None = None) -> torch.Tensor:
    """`kernels.attention.paged_attention_ref` semantics, batch invariant.

    Every query is one bmm item of `GROUP` rows (its heads sharing a kv head) against one key
    chunk at a time; decode queries of all sequences share one bmm per chunk, a prefill
    sequence's queries share one per chunk and kv head (keys expanded, not copied). Softmax is
    online over the chunks; the row sum rides in the PV GEMM as a column of ones."""
    attention.check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:])]
    decode_ids = [i for i, n in enumerate(q_lens) if n == 1]
    if decode_ids:
        rows = torch.tensor([starts[i] for i in decode_ids], device=q.device)
        seqs = torch.tensor(decode_ids, device=q.device)
        out[rows] = _attend_chunked(
            q[rows][:, None], (seq_lens[seqs].long() - 1)[:, None], k_cache, v_cache, block_tables[seqs],
            seq_lens[seqs].long(), scale, sliding_window, soft_cap)[:, 0]
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            s = starts[i]
            q_pos = torch.arange(lens[i] - q_len, lens[i], device=q.device)
            out[s:s + q_len] = _attend_chunked(
                q[s:s + q_len][None], q_pos[None], k_cache, v_cache, block_tables[i:i + 1],
                seq_lens[i:i + 1].long(), scale, sliding_window, soft_cap)[0]
    return out


def _attend_chunked(q, q_pos, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                    soft_cap):
    """q `[S, T, H, D]` at positions `q_pos [S, T]` of S sequences -> `[S, T, H, D]`.

    Per sequence and kv head, the rows (token, head in group) are cut into tiles of fixed
    size (`row_tile`); a tile is one GEMM item against one key chunk, so each row's bits depend only on its
    own query, its keys and the fixed shapes."""
    S, T, H, D = q.shape
    kv_heads = k_cache.shape[2]
    group = H // kv_heads
    num_chunks = -(-int(seq_lens.max()) // KV_CHUNK)
    # [S, L, KVH, D], fp32 whatever the cache's dtype (the math is fp32)
    k = _gather_padded(k_cache, block_tables, seq_lens, num_chunks * KV_CHUNK).float()
    v = _gather_padded(v_cache, block_tables, seq_lens, num_chunks * KV_CHUNK).float()
    past_end = torch.arange(k.shape[1], device=q.device) >= seq_lens[:, None]  # [S, L]
    v[past_end.nonzero(as_tuple=True)] = 0.0  # masked keys get p = 0, and 0 * NaN is NaN
    first_chunk = 0
    if sliding_window is not None:
        first_chunk = max(0, int(q_pos.min()) - sliding_window + 1) // KV_CHUNK
    # rows of a (sequence, kv head): row = token * group + head in group, padded to tiles
    num_rows = T * group
    tile = row_tile(group)
    num_tiles = -(-num_rows // tile)
    pad = num_tiles * tile - num_rows
    rows = q.float().view(S, T, kv_heads, group, D).permute(0, 2, 1, 3, 4).reshape(
        S, kv_heads, num_rows, D)
    rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))  # [S, KVH, num_tiles * tile, D]
    row_pos = torch.nn.functional.pad(q_pos.repeat_interleave(group, dim=1), (0, pad),
                                      value=-1)  # [S, rows]; -1: padding row, sees nothing
    row_pos = row_pos.view(S * num_tiles, tile, 1)
    out = torch.empty_like(rows)
    for h in range(kv_heads):
        tiles = rows[:, h].reshape(S * num_tiles, tile, D)
        out[:, h] = _attend_tiles(tiles, row_pos, k[:, :, h], v[:, :, h], num_tiles,
                                  range(first_chunk, num_chunks), scale, sliding_window,
                                  soft_cap).view(S, num_tiles * tile, D)
    out = out[:, :, :num_rows].reshape(S, kv_heads, T, group, D).permute(0, 2, 1, 3, 4)
    return out.reshape(S, T, H, D).to(q.dtype)


def _attend_tiles(q, q_pos, k, v, tiles_per_seq, chunks, scale, sliding_window, soft_cap):
    """Online softmax of row tiles q `[I, R, D]` over the key chunks of one kv head;
    k/v `[S, L, D]`, tile i reads sequence i // tiles_per_seq."""
    num_tiles, R, D = q.shape
    width = -(-(D + 1) // 16) * 16  # v, a ones column (the softmax denominator), zero pad
    m = torch.full((num_tiles, R, 1), float("-inf"))
    acc = torch.zeros(num_tiles, R, width)
    for c in chunks:
        lo = c * KV_CHUNK
        k_c = _per_tile(k[:, lo:lo + KV_CHUNK].contiguous(), tiles_per_seq)  # [I, C, D]
        v_c = k.new_zeros(k.shape[0], KV_CHUNK, width)
        v_c[..., :D] = v[:, lo:lo + KV_CHUNK]
        v_c[..., D] = 1.0
        scores = items_mm(q, k_c.transpose(1, 2)) * scale  # [I, R, C]
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        k_pos = torch.arange(lo, lo + KV_CHUNK)
        visible = k_pos <= q_pos  # [I, R, C]
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = torch.where(visible, scores, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet
        p = torch.exp(scores - m_safe)
        acc = acc * torch.exp(m - m_safe) + items_mm(p, _per_tile(v_c, tiles_per_seq))
        m = m_new
    return acc[..., :D] / acc[..., D:D + 1]


def _per_tile(x: torch.Tensor, tiles_per_seq: int) -> torch.Tensor:
    """`[S, ...]` -> `[S * tiles_per_seq, ...]`: each sequence's tensor for each of its tiles
    (a stride-0 view for one sequence)."""
    if tiles_per_seq == 1:
        return x
    if x.shape[0] == 1:
        return x.expand(tiles_per_seq, *x.shape[1:])
    return x.repeat_interleave(tiles_per_seq, dim=0)


def _gather_padded(cache, block_tables, seq_lens, num_positions):
    """`attention.gather_kv` of the sequences' positions, zero-padded (or cut: F.pad crops
    on a negative pad) to exactly num_positions."""
    kv = attention.gather_kv(cache, block_tables, int(seq_lens.max()))
    return torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, num_positions - kv.shape[1]))


# ---------------------------------------------------------------- fixed-shape batched GEMM

_bmm_is_itemwise: dict[tuple, bool] = {}


def items_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[I, R, X] @ [I, X, Y]` where item i's bits depend only on item i.

    `bmm` when a probe has shown that, for these item shapes, its items do not depend on the
    batch count, their index or a stride-0 operand (MKL picks other kernels for some small
    shapes, e.g. R < 4); otherwise one fixed-shape `mm` per item."""
    key = (tuple(a.shape[1:]), tuple(b.shape[1:]), b.stride()[1:], a.dtype)
    if key not in _bmm_is_itemwise:
        _bmm_is_itemwise[key] = _probe_bmm(a.shape[1:], b, a.dtype)
    if _bmm_is_itemwise[key]:
        return torch.bmm(a, b)
    return torch.stack([torch.mm(a[i], b[i]) for i in range(a.shape[0])])


def _probe_bmm(a_shape, b_like, dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    n = 6
    a = torch.randn(n, *a_shape, generator=gen).to(dtype)
    b_items = torch.randn(n, b_like.shape[2], b_like.shape[1], generator=gen).to(dtype)
    b = b_items.transpose(1, 2) if b_like.stride(1) == 1 else b_items.transpose(1, 2).contiguous()
    full = torch.bmm(a, b)
    if not all(torch.equal(torch.mm(a[i], b[i]), full[i]) for i in range(n)):
        return False
    if not all(torch.equal(torch.bmm(a[i:i + 1], b[i:i + 1])[0], full[i]) for i in range(n)):
        return False
    perm = torch.tensor([3, 0, 5, 1])
    if not torch.equal(torch.bmm(a[perm], b[perm]), full[perm]):
        return False
    shared = torch.bmm(a, b[:1].expand_as(b))
    return all(torch.equal(torch.mm(a[i], b[0]), shared[i]) for i in range(n))

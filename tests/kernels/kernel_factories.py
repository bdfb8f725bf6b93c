"""Factories for kernel tests: paged KV batches and a naive attention to check against."""
import torch


def make_paged_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                     dtype=torch.float32, device="cpu", seed=0):
    """A random varlen batch; `seqs` is a list of `(seq_len, q_len)`. See `pack_paged_batch`."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for seq_len, q_len in seqs:
        k, v = (torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) for _ in range(2))
        q = torch.randn(q_len, num_heads, head_dim, generator=gen)
        parts.append((k.to(dtype), v.to(dtype), q.to(dtype)))
    return pack_paged_batch(parts, block_size, device, seed)


def pack_paged_batch(parts, block_size=4, device="cpu", seed=0):
    """Paged-attention arguments for sequences given as `(k, v, q)`: k, v the sequence's full
    `[seq_len, num_kv_heads, head_dim]` keys/values, q its last `q_len` queries.

    Blocks are shuffled; unused cache slots and block-table padding hold NaN / -1 so that
    reading them shows up. Returns a dict with the arguments plus `k_seqs` / `v_seqs`."""
    gen = torch.Generator().manual_seed(seed)
    k0 = parts[0][0]
    num_kv_heads, head_dim = k0.shape[1:]
    blocks_per_seq = [-(-k.shape[0] // block_size) for k, _, _ in parts]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=k0.dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=k0.dtype)
    block_tables = torch.full((len(parts), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for i, (k, v, _) in enumerate(parts):
        ids = block_ids[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_tables[i, :len(ids)] = ids.int()
        slots = (ids[:, None] * block_size + torch.arange(block_size)).flatten()[:k.shape[0]]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
    q_lens = [q.shape[0] for _, _, q in parts]
    query_start_loc = torch.tensor([0] + q_lens).cumsum(0).int()
    seq_lens = torch.tensor([k.shape[0] for k, _, _ in parts], dtype=torch.int32)
    on = lambda t: t.to(device)  # noqa: E731
    return dict(q=on(torch.cat([q for _, _, q in parts])), k_cache=on(k_cache),
                v_cache=on(v_cache), block_tables=on(block_tables),
                query_start_loc=on(query_start_loc), seq_lens=on(seq_lens),
                k_seqs=[k for k, _, _ in parts], v_seqs=[v for _, v, _ in parts])


def attention_args(batch):
    """The positional tensor arguments of paged_attention, in order."""
    return tuple(batch[name] for name in (
        "q", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens"))


def naive_attention(batch, scale, sliding_window=None, soft_cap=None):
    """fp64, one query at a time, straight from the definition."""
    q = batch["q"].cpu().double()
    starts = batch["query_start_loc"].tolist()
    out = torch.zeros_like(q)
    group = q.shape[1] // batch["k_seqs"][0].shape[1]
    for i, (k, v) in enumerate(zip(batch["k_seqs"], batch["v_seqs"])):
        seq_len = k.shape[0]
        q_len = starts[i + 1] - starts[i]
        k = k.double().repeat_interleave(group, dim=1)  # [L, num_heads, head_dim]
        v = v.double().repeat_interleave(group, dim=1)
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            row = starts[i] + j
            scores = torch.einsum("hd,lhd->hl", q[row], k[lo:pos + 1]) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo:pos + 1])
    return out

"""Factories for kernel tests: paged KV batches and a naive attention to check against."""
import torch


def make_paged_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                     dtype=torch.float32, device="cpu", seed=0):
    """A varlen batch over a shuffled, NaN-poisoned paged cache.

    `seqs` is a list of `(seq_len, q_len)`. Returns a dict with the paged-attention arguments
    plus `k_seqs`/`v_seqs`: each sequence's full `[seq_len, num_kv_heads, head_dim]` keys/values.
    Unused cache slots and block-table padding hold NaN / -1 so that reading them shows up."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    k_seqs, v_seqs, used = [], [], 0
    for i, (seq_len, _) in enumerate(seqs):
        ids = block_ids[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_tables[i, :len(ids)] = ids.int()
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = ids.repeat_interleave(block_size) * block_size + torch.arange(
            block_size).repeat(len(ids))
        k_cache.view(-1, num_kv_heads, head_dim)[slots[:seq_len]] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots[:seq_len]] = v
        k_seqs.append(k)
        v_seqs.append(v)
    q_lens = [q_len for _, q_len in seqs]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int()
    seq_lens = torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int32)
    on = lambda t: t.to(device)  # noqa: E731
    return dict(q=on(q), k_cache=on(k_cache), v_cache=on(v_cache),
                block_tables=on(block_tables), query_start_loc=on(query_start_loc),
                seq_lens=on(seq_lens), k_seqs=k_seqs, v_seqs=v_seqs)


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

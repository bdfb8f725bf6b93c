"""MLA split-KV decode (kernels/mla_decode.py): the triton kernel against attention written
out from its definition in fp64 and against the torch reference the CPU path runs; rows
that are not decodes left alone; a row's result independent of the batch around it."""
import pytest
import torch

from kernel_factories import attention_args, pack_paged_batch
from duplex.kernels.mla_decode import mla_attend_ref

RANK, HALF = 32, 20  # D = 40: kv_lora_rank 32 + 8 rope dims, split over the two planes
SCALE = 0.2


def latent_batch(seqs, num_heads, device="cpu", seed=0):
    """A paged latent batch: per sequence a latent [L, D] over the two planes and q_len
    absorbed queries [q_len, heads, D]."""
    gen = torch.Generator().manual_seed(seed)
    parts, latents = [], []
    for seq_len, q_len in seqs:
        latent = torch.randn(seq_len, 2 * HALF, generator=gen)
        latents.append(latent)
        parts.append((latent[:, None, :HALF].clone(), latent[:, None, HALF:].clone(),
                      torch.randn(q_len, num_heads, 2 * HALF, generator=gen)))
    batch = pack_paged_batch(parts, block_size=16, device=device, seed=seed)
    batch["latents"] = latents
    return batch


def from_definition(batch, row_of_seq):
    """fp64: each decode row's softmax(q . latent * scale) @ latent[:, :rank]."""
    q = batch["q"].cpu().double()
    out = {}
    for seq, row in row_of_seq.items():
        latent = batch["latents"][seq].double()
        probs = (torch.einsum("hd,ld->hl", q[row], latent) * SCALE).softmax(-1)
        out[row] = probs @ latent[:, :RANK]  # [heads, rank]
    return out


@pytest.mark.parametrize("num_heads", [4, 20])  # one head block, and two with a ragged end
def test_decode_rows_match_the_definition_and_the_reference(device, num_heads):
    from duplex.kernels.mla_decode import mla_decode_triton
    seqs = [(1, 1), (37, 1), (5, 3), (600, 1)]  # 600 keys: three splits of 256
    batch = latent_batch(seqs, num_heads)
    args = [t.to(device) for t in attention_args(batch)]
    out = torch.full((args[0].shape[0], num_heads, RANK), 7.0, device=device)
    got = mla_decode_triton(*args, SCALE, RANK, max_seq_len=600, out=out).cpu()
    rows = {0: 0, 1: 1, 3: 5}  # decode sequence -> its row in the flattened batch
    for row, expected in from_definition(batch, rows).items():
        torch.testing.assert_close(got[row].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2:5], torch.full_like(got[2:5], 7.0))  # the prefill rows
    for seq, row in rows.items():  # the reference the CPU path runs, on the same cache
        ref = mla_attend_ref(batch["q"][row][None, None], batch["k_cache"], batch["v_cache"],
                             batch["block_tables"][seq:seq + 1],
                             batch["seq_lens"][seq:seq + 1].long(), SCALE, RANK)
        torch.testing.assert_close(got[row], ref[0, 0], atol=1e-5, rtol=1e-5)


def test_the_half_precision_path(device):
    """Half-precision caches and queries take the kernel's other dot path (p cast to the
    cache's dtype). fp16 stands in for bf16 here: triton's interpreter computes tl.dot on
    bf16 operands wrongly (on this triton, any kernel), so bf16 is checked on a GPU only."""
    from duplex.kernels.mla_decode import mla_decode_triton
    batch = latent_batch([(37, 1), (300, 1)], num_heads=4, seed=2)
    args = [t.to(device) for t in attention_args(batch)]
    args = [t.half() if t.is_floating_point() else t for t in args]
    got = mla_decode_triton(*args, SCALE, RANK, max_seq_len=300).float().cpu()
    for row, expected in from_definition(batch, {0: 0, 1: 1}).items():
        torch.testing.assert_close(got[row].double(), expected, atol=3e-3, rtol=3e-3)


def test_reference_prefill_rows_match_the_definition():
    batch = latent_batch([(9, 4)], num_heads=4)
    got = mla_attend_ref(batch["q"][None], batch["k_cache"], batch["v_cache"],
                         batch["block_tables"], batch["seq_lens"].long(), SCALE, RANK,
                         max_len=9)[0]
    latent, q = batch["latents"][0].double(), batch["q"].double()
    for j in range(4):  # query j sits at position 5 + j and sees keys 0 .. 5 + j
        visible = latent[:6 + j]
        probs = (torch.einsum("hd,ld->hl", q[j], visible) * SCALE).softmax(-1)
        torch.testing.assert_close(got[j].double(), probs @ visible[:, :RANK],
                                   atol=1e-5, rtol=1e-5)


def test_row_is_bitwise_independent_of_the_batch(device):
    from duplex.kernels.mla_decode import mla_decode_triton
    alone = latent_batch([(300, 1)], num_heads=4, seed=3)
    gen = torch.Generator().manual_seed(4)
    mixed_parts = []
    for n, q_len in ((520, 1), (300, 1), (3, 2)):
        latent = torch.randn(n, 2 * HALF, generator=gen)
        q = torch.randn(q_len, 4, 2 * HALF, generator=gen)
        mixed_parts.append([latent[:, None, :HALF].clone(), latent[:, None, HALF:].clone(), q])
    mixed_parts[1] = [alone["k_seqs"][0], alone["v_seqs"][0], alone["q"]]  # the same one
    mixed = pack_paged_batch(mixed_parts, block_size=16, device=device, seed=1)
    got_alone = mla_decode_triton(*[t.to(device) for t in attention_args(alone)], SCALE, RANK)
    got_mixed = mla_decode_triton(*attention_args(mixed), SCALE, RANK)
    assert torch.equal(got_alone[0], got_mixed[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_shape_on_the_gpu(dtype):
    """DeepSeek-V3's own latent (rank 512 + 64 rope dims, 128 heads), long and short
    decodes, against the fp32 torch reference on the same device."""
    from duplex.kernels.mla_decode import mla_decode_triton
    rank, rope, heads, block_size = 512, 64, 128, 64
    half = (rank + rope) // 2
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 300, 2049]
    blocks = [-(-n // block_size) for n in seq_lens]
    cache = torch.randn(2, sum(blocks) + 1, block_size, 1, half, generator=gen).to(dtype)
    ids = torch.randperm(sum(blocks) + 1, generator=gen)[:sum(blocks)]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = ids[used:used + n].int()
        used += n
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen).to(dtype)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    on = [t.cuda() for t in (q, cache[0], cache[1], table, starts, lens)]
    got = mla_decode_triton(*on, 0.05, rank, max_seq_len=max(seq_lens)).float()
    ref = mla_attend_ref(on[0].float()[:, None], on[1], on[2], on[3], on[5].long(), 0.05,
                         rank, max(seq_lens))[:, 0]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)

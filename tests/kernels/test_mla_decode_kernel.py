"""MLA split-KV decode (kernels/mla_decode.py): the triton kernel against attention written
out from its definition in fp64 and against the torch reference the CPU path runs; rows
that are not decodes left alone; a row's result independent of the batch around it."""
import pytest
import torch

from kernel_factories import attention_args, pack_paged_batch
from kernels.mla_decode import mla_attend_ref

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
    from kernels.mla_decode import mla_decode_triton
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
    from kernels.mla_decode import mla_decode_triton
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

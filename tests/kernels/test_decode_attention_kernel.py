"""Split-KV decode attention: the triton kernels against the paged-attention reference, and
a row's result independent of the batch around it."""
import pytest
import torch

from kernel_factories import attention_args, make_paged_batch
from duplex.kernels.attention import paged_attention_ref

# decodes of 1, 37 and 600 keys (one, one and three splits of 256), a prefill left alone
SEQS = [(1, 1), (37, 1), (5, 3), (600, 1)]
DECODE_ROWS = [0, 1, 5]


@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (300, 4.0)])
def test_triton_matches_reference(device, sliding_window, soft_cap):
    from duplex.kernels.decode_attention import decode_attention_triton
    batch = make_paged_batch(SEQS, num_heads=4, num_kv_heads=2, block_size=16)
    expected = paged_attention_ref(*attention_args(batch), 0.3, sliding_window, soft_cap)
    args = [t.to(device) for t in attention_args(batch)]
    out = torch.full_like(args[0], 7.0)
    got = decode_attention_triton(*args, 0.3, sliding_window, soft_cap, max_seq_len=600,
                                  out=out).cpu()
    torch.testing.assert_close(got[DECODE_ROWS], expected[DECODE_ROWS], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2:5], torch.full_like(got[2:5], 7.0))  # prefill rows untouched


def test_row_is_bitwise_independent_of_the_batch(device):
    from kernel_factories import pack_paged_batch
    from duplex.kernels.decode_attention import decode_attention_triton
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(300, 1, 16, generator=gen) for _ in range(2))
    q = torch.randn(1, 2, 16, generator=gen)
    other = [tuple(torch.randn(n, 1, 16, generator=gen) for _ in range(2))
             + (torch.randn(1, 2, 16, generator=gen),) for n in (520, 3)]
    alone = pack_paged_batch([(k, v, q)], block_size=16, device=device)
    mixed = pack_paged_batch([other[0], (k, v, q), other[1]], block_size=16, device=device,
                             seed=1)
    got_alone = decode_attention_triton(*attention_args(alone), 0.25)
    got_mixed = decode_attention_triton(*attention_args(mixed), 0.25)
    assert torch.equal(got_alone[0], got_mixed[1])


def test_split_dispatch_matches_reference_on_a_mixed_step(device):
    from duplex.kernels.decode_attention import StepLens, paged_attention_split
    seqs = [(37, 1), (5, 3), (7, 0), (20, 6)]
    batch = make_paged_batch(seqs, num_heads=4, num_kv_heads=2, block_size=16)
    expected = paged_attention_ref(*attention_args(batch), 0.3)
    args = [t.to(device) for t in attention_args(batch)]
    lens = StepLens.of([n for _, n in seqs], [n for n, _ in seqs])
    got = paged_attention_split(*args, 0.3, lens).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 700])
def test_triton_large(dtype, sliding_window):
    from duplex.kernels.decode_attention import decode_attention_triton
    seqs = [(1000, 1)] * 24 + [(4097, 1), (1, 1), (2048, 1)]
    batch = make_paged_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=dtype, device="cuda")
    args = attention_args(batch)
    expected = paged_attention_ref(*args, 128 ** -0.5, sliding_window)
    got = decode_attention_triton(*args, 128 ** -0.5, sliding_window)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_split_kv_reads_a_bf16_cache_beside_fp32_queries(device):
    from duplex.kernels.decode_attention import decode_attention_triton
    batch = make_paged_batch(SEQS, num_heads=4, num_kv_heads=2, block_size=16)
    args = list(attention_args(batch))
    args[1], args[2] = args[1].to(torch.bfloat16), args[2].to(torch.bfloat16)
    expected = paged_attention_ref(*args, 0.3)
    args = [t.to(device) for t in args]
    got = decode_attention_triton(*args, 0.3, max_seq_len=600, out=torch.zeros_like(args[0]))
    torch.testing.assert_close(got.cpu()[DECODE_ROWS], expected[DECODE_ROWS], atol=1e-5,
                               rtol=1e-5)

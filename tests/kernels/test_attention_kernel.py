"""Paged attention: the torch reference against a naive definition, the triton kernel against
the reference."""
import pytest
import torch

from kernel_factories import attention_args, make_paged_batch, naive_attention
from duplex.kernels.attention import paged_attention_ref

# (seq_len, q_len): decodes, a prefill chunk over a cached prefix, a full prefill, a q_len 0
MIXED = [(9, 1), (5, 3), (1, 1), (12, 12), (17, 1), (7, 0), (20, 6)]


@pytest.mark.parametrize("sliding_window", [None, 1, 4])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_reference_matches_naive(sliding_window, soft_cap, num_heads, num_kv_heads):
    batch = make_paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)
    out = paged_attention_ref(*attention_args(batch), 0.3, sliding_window, soft_cap)
    expected = naive_attention(batch, 0.3, sliding_window, soft_cap)
    assert out.dtype == torch.float32 and out.shape == batch["q"].shape
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_bf16_computes_in_fp32():
    batch = make_paged_batch(MIXED, dtype=torch.bfloat16)
    out = paged_attention_ref(*attention_args(batch), 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.25), atol=1e-2, rtol=1e-2)


def test_reference_rejects_bad_inputs_in_plain_words():
    batch = make_paged_batch([(5, 2)])
    args = list(attention_args(batch))
    args[3] = args[3].long()
    with pytest.raises(AssertionError, match="block_tables must be int32"):
        paged_attention_ref(*args, 1.0)


@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (3, None), (None, 4.0),
                                                      (5, 4.0)])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2)])
def test_triton_matches_reference(device, sliding_window, soft_cap, num_heads, num_kv_heads):
    from duplex.kernels.attention import paged_attention_triton
    batch = make_paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)
    expected = paged_attention_ref(*attention_args(batch), 0.3, sliding_window, soft_cap)
    args = [t.to(device) for t in attention_args(batch)]
    got = paged_attention_triton(*args, 0.3, sliding_window, soft_cap, block_m=16, block_n=16)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 256])
def test_triton_large(dtype, sliding_window):
    from duplex.kernels.attention import paged_attention_triton
    seqs = [(1000, 1)] * 24 + [(700, 300), (513, 513), (2048, 17)]
    batch = make_paged_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=dtype, device="cuda")
    args = attention_args(batch)
    expected = paged_attention_ref(*args, 128 ** -0.5, sliding_window)
    got = paged_attention_triton(*args, 128 ** -0.5, sliding_window)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_triton_token_identical_in_prefill_and_decode():
    """Per-row programs with key tiles at absolute positions: batch invariant on GPU too."""
    from kernel_factories import pack_paged_batch
    from duplex.kernels.attention import paged_attention_triton
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(600, 8, 128, generator=gen).half() for _ in range(2))
    q = torch.randn(600, 32, 128, generator=gen).half()
    other = tuple(torch.randn(300, n, 128, generator=gen).half() for n in (8, 8, 32))
    batch = pack_paged_batch([(k, v, q[-50:])], block_size=16, device="cuda")
    prefill = paged_attention_triton(*attention_args(batch), 0.1)
    for pos in (550, 599):
        batch = pack_paged_batch([other, (k[:pos + 1], v[:pos + 1], q[pos:pos + 1])],
                                 block_size=16, device="cuda")
        decode = paged_attention_triton(*attention_args(batch), 0.1)
        assert torch.equal(decode[-1], prefill[pos - 550])


def _with_bf16_cache(batch):
    """The batch's arguments with its caches rounded to bf16, and the fp32 queries kept."""
    args = list(attention_args(batch))
    args[1], args[2] = args[1].to(torch.bfloat16), args[2].to(torch.bfloat16)
    return args


def test_triton_reads_a_bf16_cache_beside_fp32_queries(device):
    """--kv-cache-dtype bfloat16 with fp32 activations: the kernel widens the cache's tiles
    to q's dtype, so it equals the reference on the same (rounded) cache values."""
    from duplex.kernels.attention import paged_attention_triton
    batch = make_paged_batch(MIXED, num_heads=6, num_kv_heads=2)
    args = _with_bf16_cache(batch)
    expected = paged_attention_ref(*args, 0.3, 3)
    assert expected.dtype == torch.float32
    got = paged_attention_triton(*[t.to(device) for t in args], 0.3, 3, block_m=16, block_n=16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)

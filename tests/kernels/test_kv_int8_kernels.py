"""The int8 KV cache (`--kv-cache-dtype int8`, kernels/kv_store.py): packed rows of int8
values and an fp32 scale, written by the torch and triton stores and read back by every
attention path (torch reference, planned, batch-invariant, triton paged and split decode)
as the dequantized values; the C kernels refuse such a pool."""
from __future__ import annotations

import pytest
import torch

from duplex.kernels import batch_invariant as bi
from duplex.kernels import cpu_attention, cpu_decode
from duplex.kernels.attention import paged_attention_planned, paged_attention_ref, plan_attention
from duplex.kernels.kv_store import (SCALE_BYTES, cache_head_dim, dequantize_rows,
                                     quantize_rows, row_width, store_kv_ref)
from tests.kernels.kernel_factories import attention_args, naive_attention, pack_paged_batch

SEQS = [(1, 1), (37, 1), (5, 3), (40, 40), (21, 6), (300, 1)]


def _rows(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 8
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    return x


def test_a_row_is_int8_values_then_its_fp32_scale():
    x = _rows(5, 3, 16)
    packed = quantize_rows(x)
    assert packed.dtype == torch.int8 and packed.shape == (5, 3, 16 + SCALE_BYTES)
    scale = packed[..., 16:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127, rtol=0, atol=0)
    values = packed[..., :16].float()
    assert int(values.abs().max()) == 127 and bool((values[0, 0] == 0).all())
    assert row_width(16, torch.int8) == 20 and row_width(16, torch.bfloat16) == 16
    assert cache_head_dim(packed) == 16


def test_dequantized_rows_are_within_half_a_step():
    x = _rows(64, 4, 32, seed=1)
    back = dequantize_rows(quantize_rows(x))
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())
    assert torch.equal(back[0, 0], torch.zeros(32))
    # bf16 rounds to 8 bits of mantissa, int8 to 7 bits of the row's range: same ballpark
    assert float((back - x).abs().max()) < float(x.abs().max()) / 127


def _store_case(num_tokens=9, num_blocks=4, block_size=4, heads=2, head_dim=8):
    k, v = _rows(num_tokens, heads, head_dim, seed=2), _rows(num_tokens, heads, head_dim, seed=3)
    cache = torch.zeros(num_blocks, block_size, heads, row_width(head_dim, torch.int8),
                        dtype=torch.int8)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(4))
    return k, v, cache, cache.clone(), slots[:num_tokens]


def test_store_writes_packed_rows_at_the_slots_and_skips_padding():
    k, v, k_cache, v_cache, slots = _store_case()
    slots[3] = -1
    store_kv_ref(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 12), v_cache.view(-1, 2, 12)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], quantize_rows(k[token]))
            assert torch.equal(flat_v[slot], quantize_rows(v[token]))
    assert int(flat_k.abs().sum(-1).ne(0).any(-1).sum()) == len(slots) - 1


def test_triton_store_is_bitwise_the_reference(device):
    from duplex.kernels.kv_store import store_kv_triton
    k, v, k_cache, v_cache, slots = _store_case(num_tokens=11, num_blocks=3, heads=3,
                                                head_dim=12)
    slots[5] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    on = [t.to(device) for t in (k, v, k_cache, v_cache, slots)]
    store_kv_triton(*on)
    assert torch.equal(on[2].cpu(), expected_k) and torch.equal(on[3].cpu(), expected_v)


def _int8_parts(seqs=SEQS, num_heads=4, num_kv_heads=2, head_dim=16, seed=0):
    """(k, v, q) of each sequence, k and v already on the int8 grid (dequantized values)."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for i, (seq_len, q_len) in enumerate(seqs):
        k, v = (dequantize_rows(quantize_rows(_rows(seq_len, num_kv_heads, head_dim,
                                                      seed=seed + 2 * i + j)))
                for j in range(2))
        parts.append((k, v, torch.randn(q_len, num_heads, head_dim, generator=gen)))
    return parts


def _int8_batch(parts, block_size=16, seed=0):
    """A paged batch on an int8 pool (unused slots: finite garbage) and its float twin holding
    the dequantized keys and values, which every int8 read must reproduce."""
    batch = pack_paged_batch(parts, block_size, seed=seed)
    int8 = dict(batch)
    for name in ("k_cache", "v_cache"):
        int8[name] = quantize_rows(batch[name].nan_to_num(nan=1e4))
        assert not dequantize_rows(int8[name]).isnan().any()
    return int8, batch


def _q_lens(batch):
    return (batch["query_start_loc"][1:] - batch["query_start_loc"][:-1]).tolist()


@pytest.mark.parametrize("window, soft_cap", [(None, None), (8, 30.0)])
def test_torch_reference_and_planned_read_the_dequantized_values(window, soft_cap):
    int8, floats = _int8_batch(_int8_parts())
    expected = naive_attention(floats, 0.3, window, soft_cap)
    ref = paged_attention_ref(*attention_args(int8), 0.3, window, soft_cap)
    torch.testing.assert_close(ref.double(), expected, rtol=1e-4, atol=1e-4)
    plan = plan_attention(int8["block_tables"], _q_lens(int8), int8["seq_lens"].tolist(),
                          16, window)
    planned = paged_attention_planned(int8["q"], int8["k_cache"], int8["v_cache"], plan, 0.3,
                                      soft_cap)
    torch.testing.assert_close(planned, ref, rtol=1e-5, atol=1e-5)


def test_attention_on_the_int8_pool_stays_close_to_the_float_values():
    """Against the unquantized keys and values: the error a quantization step allows."""
    gen = torch.Generator().manual_seed(5)
    parts = [tuple(torch.randn(n, 2, 16, generator=gen) for _ in range(2))
             + (torch.randn(1, 4, 16, generator=gen),) for n in (30, 90)]
    floats = pack_paged_batch(parts, 16)
    int8 = dict(floats, k_cache=quantize_rows(floats["k_cache"].nan_to_num(nan=0.0)),
                v_cache=quantize_rows(floats["v_cache"].nan_to_num(nan=0.0)))
    got = paged_attention_ref(*attention_args(int8), 0.25)
    exact = naive_attention(floats, 0.25).float()
    assert 0 < float((got - exact).abs().max()) < 0.03


def test_batch_invariant_attention_reads_int8_rows_invariantly():
    parts = _int8_parts([(37, 1), (21, 6)])
    int8, floats = _int8_batch(parts)
    alone, _ = _int8_batch(parts[1:], seed=1)
    with bi.set_batch_invariant_mode():
        both = bi.bi_paged_attention(*attention_args(int8), 0.3)
        one = bi.bi_paged_attention(*attention_args(alone), 0.3)
    torch.testing.assert_close(both.double(), naive_attention(floats, 0.3), rtol=1e-4, atol=1e-4)
    assert torch.equal(both[1:], one)


@pytest.mark.parametrize("window, soft_cap", [(None, None), (8, 30.0)])
def test_triton_paged_attention_reads_int8_rows(device, window, soft_cap):
    from duplex.kernels.attention import paged_attention_triton
    int8, floats = _int8_batch(_int8_parts())
    args = [t.to(device) for t in attention_args(int8)]
    got = paged_attention_triton(*args, 0.3, window, soft_cap, block_m=16, block_n=16).cpu()
    torch.testing.assert_close(got.double(), naive_attention(floats, 0.3, window, soft_cap),
                               rtol=1e-4, atol=1e-4)


def test_triton_split_decode_reads_int8_rows(device):
    from duplex.kernels.decode_attention import StepLens, paged_attention_split
    int8, floats = _int8_batch(_int8_parts())
    args = [t.to(device) for t in attention_args(int8)]
    lens = StepLens.of(_q_lens(int8), int8["seq_lens"].tolist())
    got = paged_attention_split(*args, 0.3, lens).cpu()
    torch.testing.assert_close(got.double(), naive_attention(floats, 0.3), rtol=1e-4, atol=1e-4)


def test_the_c_kernels_refuse_an_int8_pool():
    """cpu_attention (AVX-512) and the one-call decode step read float caches only: an int8
    pool takes the torch paths, whatever the machine."""
    int8, _ = _int8_batch(_int8_parts([(9, 1)]))
    assert not cpu_attention.fits(int8["q"], int8["k_cache"], None)
    assert cpu_attention.fits(int8["q"], dequantize_rows(int8["k_cache"]), None)
    h = torch.zeros(1, 8)
    steps = (torch.zeros(1, dtype=torch.int64),) * 2 + (
        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    assert not cpu_decode.step_fits(h, *steps, [(int8["k_cache"], int8["v_cache"])])
    assert cpu_decode.step_fits(h, *steps, [(torch.zeros(2, 2), torch.zeros(2, 2))])

"""duplex.kernels.cpu_attention (decode attention read in place from the paged cache) against the
reference, through the planned path that the engine calls while the fused kernels are on."""
from __future__ import annotations

import pytest
import torch

from duplex.kernels import cpu_attention
from duplex.kernels.attention import paged_attention_planned, paged_attention_ref, plan_attention
from duplex.kernels.cpu_fused import use_fused
from tests.kernels.kernel_factories import attention_args, make_paged_batch, naive_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="no C compiler, or neither AVX2 nor AVX512 on this CPU")

SEQS = {
    "one decode": [(37, 1)],
    "decodes of unequal lengths": [(9, 1), (40, 1), (3, 1), (17, 1)],
    "one key": [(1, 1), (2, 1)],
    "mixed with prefills": [(17, 1), (25, 25), (33, 1), (21, 6), (7, 0)],
}


@pytest.mark.parametrize("heads", [(6, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("window", [None, 1, 8])
@pytest.mark.parametrize("name", list(SEQS))
def test_equals_the_reference(name, window, heads):
    batch = make_paged_batch(SEQS[name], num_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=32, seed=len(name) + heads[0])
    q_lens = (batch["query_start_loc"][1:] - batch["query_start_loc"][:-1]).tolist()
    plan = plan_attention(batch["block_tables"], q_lens, batch["seq_lens"].tolist(),
                          batch["k_cache"].shape[1], window)
    assert cpu_attention.fits(batch["q"], batch["k_cache"], None)
    with use_fused(True):
        out = paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"], plan, 0.2)
    ref = paged_attention_ref(*attention_args(batch), 0.2, window)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.2, window), rtol=1e-4,
                               atol=1e-4)


def test_it_is_the_kernel_that_runs(monkeypatch):
    batch = make_paged_batch([(12, 1), (30, 1)], num_heads=4, num_kv_heads=2, head_dim=16)
    plan = plan_attention(batch["block_tables"], [1, 1], batch["seq_lens"].tolist(),
                          batch["k_cache"].shape[1])
    calls = []
    real = cpu_attention.decode
    monkeypatch.setattr(cpu_attention, "decode", lambda *a: calls.append(1) or real(*a))
    paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"], plan, 0.3)
    assert calls == []  # the exact mode keeps SDPA
    with use_fused(True):
        paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"], plan, 0.3)
    assert calls == [1]


def test_soft_cap_and_odd_head_dims_keep_the_torch_path():
    q = torch.randn(2, 4, 24)
    cache = torch.randn(3, 4, 2, 24)
    assert not cpu_attention.fits(q, cache, None)
    q, cache = torch.randn(2, 4, 32), torch.randn(3, 4, 2, 32)
    assert cpu_attention.fits(q, cache, None) and not cpu_attention.fits(q, cache, 30.0)




def _direct_case(batch, heads, kv_heads, head_dim, num_keys, dtype, seed):
    """q, k/v caches of `dtype` [blocks, 16, kv_heads, D], key slots in a shuffled order and
    unequal counts -> (kernel output, float64 softmax attention over the same cache values)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = batch * -(-num_keys // 16) + 3
    k, v = (torch.randn(blocks, 16, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
    q = torch.randn(batch, heads, head_dim, generator=gen)
    keys = torch.randperm(blocks * 16, generator=gen)[:batch * num_keys].view(batch, num_keys)
    counts = torch.randint(1, num_keys + 1, (batch,), generator=gen)
    counts[0] = num_keys
    out = cpu_attention.decode(q, k, v, None, keys.contiguous(), counts, head_dim ** -0.5)
    group = heads // kv_heads
    ref = []
    for b in range(batch):
        seen = keys[b, :counts[b]]
        kk, vv = (c.flatten(0, 1)[seen].double() for c in (k, v))  # [n, kv_heads, D]
        scores = torch.einsum("jgd,njd->jgn", q[b].double().view(kv_heads, group, head_dim),
                              kk) * head_dim ** -0.5
        ref.append(torch.einsum("jgn,njd->jgd", scores.softmax(-1), vv).reshape(heads, head_dim))
    return out, torch.stack(ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (1, 9, 3, 64, 1), (3, 9, 3, 64, 17), (64, 9, 3, 64, 129), (2, 8, 1, 128, 40),
    (5, 4, 4, 16, 33), (4, 12, 3, 80, 16), (2, 32, 2, 48, 15), (7, 6, 3, 64, 300),
    (1, 16, 8, 96, 64), (8, 14, 2, 64, 16)])
def test_every_tile_shape_against_float64(shape, dtype, build):
    """Groups of 1 to 16 heads (the score and value tiles hold 4 and 3 heads: remainders),
    head dims that are not multiples of the 64-wide value tile, key counts on both sides
    of the 16-key score tile, fp32 and bf16 caches (bf16 widened exactly: same tolerance)."""
    out, ref = _direct_case(*shape, dtype, seed=sum(shape))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-5)


def test_bf16_cache_gives_the_fp32_kernel_s_result_on_the_same_values(build):
    """The bf16 entry widens each element exactly, so it equals the fp32 entry run on the
    widened cache bit for bit."""
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(20, 16, 3, 64, generator=gen).to(torch.bfloat16) for _ in "kv")
    q = torch.randn(6, 9, 64, generator=gen)
    keys = torch.randperm(320, generator=gen)[:6 * 50].view(6, 50).contiguous()
    counts = torch.tensor([50, 1, 16, 17, 33, 49])
    half = cpu_attention.decode(q, k, v, None, keys, counts, 0.125)
    full = cpu_attention.decode(q, k.float(), v.float(), None, keys, counts, 0.125)
    assert torch.equal(half, full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 16, 8, 128, 1100), (1, 8, 2, 64, 1500), (5, 9, 3, 64, 700)])
def test_sequences_cut_into_chunks_against_float64(shape, dtype, build):
    """Sequences longer than a chunk (AVX512: 1 MB of keys and values, 128 keys of 8 x 128
    fp32 heads, 512 of small heads; AVX2: 512 KB) are cut into units whose partial results
    are merged; one sequence also splits its chunks by kv head (too few chunks for the
    threads)."""
    out, ref = _direct_case(*shape, dtype, seed=sum(shape))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-5)


def test_a_sequence_s_result_does_not_depend_on_its_batch_or_the_threads(build):
    """How a sequence is cut depends on its length alone: alone or beside others, on one
    thread or two, its output is the same bits."""
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(300, 16, 4, 64, generator=gen).to(torch.bfloat16) for _ in "kv")
    q = torch.randn(4, 8, 64, generator=gen)
    keys = torch.randperm(4800, generator=gen)[:4 * 1200].view(4, 1200).contiguous()
    counts = torch.tensor([1200, 37, 900, 513])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = cpu_attention.decode(q, k, v, None, keys, counts, 0.125)
        torch.set_num_threads(1)
        single = cpu_attention.decode(q, k, v, None, keys, counts, 0.125)
        alone = [cpu_attention.decode(q[i:i + 1], k, v, None, keys[i:i + 1].contiguous(),
                                      counts[i:i + 1], 0.125) for i in range(4)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, single)
    assert torch.equal(batch, torch.cat(alone))


def _prompt_case(queries, num_keys, heads, kv_heads, head_dim, dtype, seed):
    """One sequence's last `queries` positions over its `num_keys` keys (slots shuffled) ->
    (cache, q, key slots, float64 causal attention: query i sees keys up to L - Q + i)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-num_keys // 16) + 2
    k, v = (torch.randn(blocks, 16, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
    q = torch.randn(queries, heads, head_dim, generator=gen)
    keys = torch.randperm(blocks * 16, generator=gen)[:num_keys].contiguous()
    kk, vv = (c.flatten(0, 1)[keys].double() for c in (k, v))  # [L, kv_heads, D]
    group = heads // kv_heads
    scores = torch.einsum("qjgd,ljd->qjgl", q.double().view(queries, kv_heads, group, head_dim),
                          kk) * head_dim ** -0.5
    seen = torch.arange(num_keys)[None, :] <= torch.arange(num_keys - queries, num_keys)[:, None]
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    ref = torch.einsum("qjgl,ljd->qjgd", scores.softmax(-1), vv).reshape(queries, heads, head_dim)
    return k, v, q, keys, ref


@pytest.fixture(params=["native", "avx2"])
def build(request, monkeypatch):
    """The kernels as this CPU's default build runs them, and as a CPU with AVX2 and no
    AVX512 does (most laptops: the 8-lane walks), built with -mno-avx512f and run here."""
    if request.param == "avx2":
        monkeypatch.setattr(cpu_attention, "_lib", cpu_attention._lib)  # restored after
        if not cpu_attention.use_avx2_build():
            pytest.skip("no AVX2 on this CPU")
        assert cpu_attention._load().attn_lanes() == 8  # the AVX2 build is what runs
        assert cpu_attention._load().prefill_available()
    return request.param


def _needs_prompt_kernel():
    if not cpu_attention.prefill_available():
        pytest.skip("no prompt kernel in this build (AVX512 or AVX2 + FMA)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (1, 1, 4, 2, 64), (5, 5, 9, 3, 64), (16, 16, 8, 1, 32), (37, 100, 6, 2, 48),
    (40, 40, 32, 2, 16), (64, 64, 12, 3, 80), (17, 53, 4, 4, 128), (9, 300, 8, 8, 256),
    (33, 33, 32, 8, 64)])
def test_prompt_kernel_against_float64(shape, dtype, build):
    """Positions in blocks of 16 and their remainders, prompts with and without a cached
    prefix, groups of 1 to 16 heads, head dims 16 to 256, fp32 and bf16 caches; the AVX512
    walk (tiles of 16 keys) and the AVX2 one (tiles of 8)."""
    _needs_prompt_kernel()  # after `build` has loaded the build under test
    queries, num_keys, heads, kv_heads, head_dim = shape
    k, v, q, keys, ref = _prompt_case(*shape, dtype, seed=sum(shape))
    out = torch.full_like(q, float("nan"))
    cpu_attention.prefill(q, k, v, keys, head_dim ** -0.5, out)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-5)


def test_prompt_rows_do_not_depend_on_how_the_prompt_is_cut(build):
    """A position's output is the same bits whether its prompt runs whole or in chunks
    (key tiles start at key 0, a row's masked keys add exactly nothing), on any threads."""
    _needs_prompt_kernel()  # after `build` has loaded the build under test
    k, v, q, keys, _ = _prompt_case(70, 70, 8, 2, 64, torch.bfloat16, seed=5)
    whole = torch.empty_like(q)
    cpu_attention.prefill(q, k, v, keys, 0.125, whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for a, b in [(0, 23), (23, 48), (48, 70)]:
            part = torch.empty(b - a, 8, 64)
            cpu_attention.prefill(q[a:b], k, v, keys[:b].contiguous(), 0.125, part)
            assert torch.equal(part, whole[a:b])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not cpu_attention.prefill_available(), reason="no prompt kernel here")
def test_planned_prompts_take_the_kernel_unless_windowed(monkeypatch):
    batch = make_paged_batch([(20, 20), (30, 7), (9, 1)], num_heads=4, num_kv_heads=2,
                             head_dim=32, seed=2)
    calls = []
    real = cpu_attention.prefill
    monkeypatch.setattr(cpu_attention, "prefill", lambda *a: calls.append(1) or real(*a))
    for window, expected in [(None, [1, 1]), (8, [])]:
        calls.clear()
        plan = plan_attention(batch["block_tables"], [20, 7, 1], batch["seq_lens"].tolist(),
                              batch["k_cache"].shape[1], window)
        with use_fused(True):
            out = paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"], plan, 0.2)
        ref = paged_attention_ref(*attention_args(batch), 0.2, window)
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
        assert calls == expected

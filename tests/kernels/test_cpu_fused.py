"""The fused CPU kernels (kernels/cpu_fused.c) against their torch references."""
from __future__ import annotations

import pytest
import torch

from duplex.kernels import cpu_fused, ops
from duplex.kernels.rms_norm import rms_norm_ref
from duplex.kernels.rotary import rope_cos_sin_cache, rotary_embedding_ref

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler")


@pytest.mark.parametrize("rows,n", [(1, 576), (7, 64), (3, 50)])
def test_rms_norm_matches_reference_within_ulps(rows, n):
    torch.manual_seed(rows)
    x, residual, w = torch.randn(rows, n), torch.randn(rows, n), torch.randn(n)
    out, new_residual = cpu_fused.rms_norm(x, w, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, w, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual)  # the add is one rounding either way
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5),
                               rtol=2e-6, atol=2e-6)


def test_rope_in_place_is_bitwise_the_reference():
    torch.manual_seed(0)
    cache = rope_cos_sin_cache(64, 256)
    positions = torch.tensor([0, 5, 255, 17])
    qkv = torch.randn(4, 9 * 64 + 2 * 3 * 64)
    q_ref, k_ref = rotary_embedding_ref(positions, qkv[:, :576].reshape(4, 9, 64),
                                        qkv[:, 576:768].reshape(4, 3, 64), cache)
    qk = qkv[:, :768].view(4, 12, 64)  # a strided view of the projection output
    assert ops.rope_inplace(qk, positions, cache)
    assert torch.equal(qk[:, :9], q_ref) and torch.equal(qk[:, 9:], k_ref)


def test_rope_in_place_declines_what_it_cannot_do():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert not ops.rope_inplace(x, torch.tensor([0, 1]), rope_cos_sin_cache(64, 8))
    partial = torch.randn(2, 3, 64)
    assert not ops.rope_inplace(partial, torch.tensor([0, 1]), rope_cos_sin_cache(32, 8))


def test_silu_mul_matches_reference():
    torch.manual_seed(1)
    gate_up = torch.randn(5, 2 * 96) * 4
    ref = torch.nn.functional.silu(gate_up[:, :96]) * gate_up[:, 96:]
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), ref, rtol=2e-6, atol=2e-6)
    with cpu_fused.use_fused(True):
        torch.testing.assert_close(ops.silu_and_mul(gate_up), ref, rtol=2e-6, atol=2e-6)
    assert not cpu_fused.is_enabled()  # the switch is scoped to its block


def test_fp32_row_kernels_share_rows_over_threads_with_the_same_bits(monkeypatch):
    """rms_norm, silu_mul and rope_neox_ on a prompt step's rows: shared out over two
    threads, every row's bits are the one-thread kernel's (the decode step calls that one)."""
    torch.manual_seed(3)
    rows, n = 67, 576  # enough rows to share out; an odd count
    x, residual, w = torch.randn(rows, n), torch.randn(rows, n), torch.randn(n)
    gate_up = torch.randn(rows, 2 * n) * 4
    cache = rope_cos_sin_cache(64, 512)
    positions = torch.randint(0, 512, (rows,))
    qk = torch.randn(rows, 12, 64)

    def run(threads):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        out, new_residual = cpu_fused.rms_norm(x, w, 1e-5, residual)
        return (out, new_residual, cpu_fused.rms_norm(x, w, 1e-5), cpu_fused.silu_mul(gate_up),
                cpu_fused.rope_neox_(qk.clone(), positions, cache))

    one, two = run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    lib, single = cpu_fused._load(), torch.empty(rows, n)
    lib.silu_mul_f32(gate_up.data_ptr(), single.data_ptr(), rows, n)
    assert torch.equal(single, two[3])


def test_ops_use_the_fused_norm_only_when_switched_on():
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))  # exact mode
    with cpu_fused.use_fused(True):
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                                   rtol=2e-6, atol=2e-6)


# --------------------------------------------------------------- the bf16 matmul stream
# The `out_dtype` forms read bf16 (widened exactly) and round their outputs once, so they
# must be bitwise the fp32 kernels on the widened values followed by torch's conversion.
def _bf16(*shape):
    return (torch.randn(*shape) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("rows,n", [(1, 576), (13, 64), (5, 50)])
def test_mixed_rms_norm_is_the_fp32_kernel_then_torch_rounding(rows, n):
    torch.manual_seed(n)
    x, residual, w = _bf16(rows, n), torch.randn(rows, n), torch.randn(n)
    out, new_residual = cpu_fused.rms_norm(x, w, 1e-5, residual, torch.bfloat16)
    ref_out, ref_residual = cpu_fused.rms_norm(x.float(), w, 1e-5, residual)
    assert out.dtype == torch.bfloat16 and new_residual.dtype == torch.float32
    assert torch.equal(new_residual, ref_residual)
    assert torch.equal(out, ref_out.to(torch.bfloat16))
    # fp32 in, bf16 out (a step's first norm); bf16 in, fp32 out (its final norm)
    h = torch.randn(rows, n)
    assert torch.equal(cpu_fused.rms_norm(h, w, 1e-5, out_dtype=torch.bfloat16),
                       cpu_fused.rms_norm(h, w, 1e-5).to(torch.bfloat16))
    final, _ = cpu_fused.rms_norm(x, w, 1e-5, residual, torch.float32)
    assert torch.equal(final, ref_out)
    alone = cpu_fused.rms_norm(x, w, 1e-5, out_dtype=torch.bfloat16)  # bf16 in, no residual
    assert torch.equal(alone, cpu_fused.rms_norm(x.float(), w, 1e-5).to(torch.bfloat16))


@pytest.mark.parametrize("n", [96, 1536, 40])
def test_mixed_silu_mul_is_the_fp32_kernel_then_torch_rounding(n):
    torch.manual_seed(n)
    gate_up = _bf16(9, 2 * n)  # 9 rows: shared out over the threads
    expect = cpu_fused.silu_mul(gate_up.float())
    assert torch.equal(cpu_fused.silu_mul(gate_up, torch.bfloat16), expect.to(torch.bfloat16))
    assert torch.equal(cpu_fused.silu_mul(gate_up, torch.float32), expect)
    with cpu_fused.use_fused(True):
        assert torch.equal(ops.silu_and_mul(gate_up, out_dtype=torch.bfloat16),
                           expect.to(torch.bfloat16))
    # the torch form of the same op (fused kernels off): computed on the widened values
    ref = torch.nn.functional.silu(gate_up[:, :n].float()) * gate_up[:, n:].float()
    torch.testing.assert_close(ops.silu_and_mul(gate_up, out_dtype=torch.float32), ref)


@pytest.mark.parametrize("qkv_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_rope_store_kv_is_rotary_then_the_cache_write(qkv_dtype, cache_dtype):
    torch.manual_seed(3)
    heads, kv_heads, d, block = 9, 3, 64, 4
    cache = rope_cos_sin_cache(d, 256)
    qkv = (torch.randn(6, (heads + 2 * kv_heads) * d) * 2).to(qkv_dtype)
    positions = torch.tensor([0, 5, 255, 17, 3, 100])
    slots = torch.tensor([9, 2, -1, 14, 0, 7])  # -1: not written (padding)
    caches = [torch.full((4, block, kv_heads, d), 7.0, dtype=cache_dtype) for _ in range(4)]
    q = ops.rope_and_store_kv(qkv, heads, kv_heads, d, positions, cache, caches[0], caches[1],
                              slots)
    # the reference: the ops it replaces, on the fp32 values
    wide = qkv.float()
    q_ref, k_ref = rotary_embedding_ref(positions, wide[:, :heads * d].reshape(6, heads, d),
                                        wide[:, heads * d:(heads + kv_heads) * d].reshape(
                                            6, kv_heads, d), cache)
    v_ref = wide[:, (heads + kv_heads) * d:].reshape(6, kv_heads, d)
    ops.store_kv(k_ref, v_ref, caches[2], caches[3], slots)
    assert q.dtype == torch.float32 and torch.equal(q, q_ref)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert (caches[0].view(-1, kv_heads, d)[1] == 7).all()  # slot 1 was never written


def test_rope_store_kv_torch_form_matches_the_kernel():
    """Where the fused kernel does not apply (here: a strided cos/sin cache), the ops it
    stands for give the same results."""
    torch.manual_seed(4)
    heads, kv_heads, d = 4, 2, 32
    cache = rope_cos_sin_cache(d, 64)
    qkv = _bf16(3, (heads + 2 * kv_heads) * d)
    positions, slots = torch.tensor([1, 2, 60]), torch.tensor([0, 5, 3])
    caches = [torch.zeros(2, 4, kv_heads, d, dtype=torch.bfloat16) for _ in range(4)]
    fused = ops.rope_and_store_kv(qkv, heads, kv_heads, d, positions, cache, *caches[:2], slots)
    strided = torch.cat([cache, cache], 1)[:, :d]  # the same values, not contiguous
    torch_form = ops.rope_and_store_kv(qkv, heads, kv_heads, d, positions, strided,
                                       *caches[2:], slots)
    assert torch.equal(fused, torch_form)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_mixed_rms_norm_torch_form_rounds_once():
    """With the fused kernels off, the `out_dtype` form is the reference on the widened
    values, rounded once."""
    x, residual, w = _bf16(4, 64), torch.randn(4, 64), torch.randn(64)
    out, new_residual = ops.rms_norm(x, w, 1e-6, residual, out_dtype=torch.bfloat16)
    ref_out, ref_residual = rms_norm_ref(x.float(), w, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)
    assert torch.equal(out, ref_out.to(torch.bfloat16))


def test_rope_store_kv_refuses_out_of_range_positions_and_slots():
    heads, kv_heads, d = 2, 1, 16
    cache = rope_cos_sin_cache(d, 8)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * d)
    k_cache, v_cache = torch.zeros(2, 4, kv_heads, d), torch.zeros(2, 4, kv_heads, d)
    with pytest.raises(IndexError, match="position|slot"):
        cpu_fused.rope_store_kv(qkv, heads, kv_heads, d, torch.tensor([0, 8]), cache,
                                torch.tensor([0, 1]), k_cache, v_cache)
    with pytest.raises(IndexError, match="slot"):
        cpu_fused.rope_store_kv(qkv, heads, kv_heads, d, torch.tensor([0, 1]), cache,
                                torch.tensor([0, 8]), k_cache, v_cache)
    assert not k_cache[0, 1:].any() and not k_cache[1].any()  # only the good row 0 written

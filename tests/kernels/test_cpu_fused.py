"""The fused CPU kernels (kernels/cpu_fused.c) against their torch references."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_fused, ops
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rope_cos_sin_cache, rotary_embedding_ref

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


def test_ops_use_the_fused_norm_only_when_switched_on():
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))  # exact mode
    with cpu_fused.use_fused(True):
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                                   rtol=2e-6, atol=2e-6)

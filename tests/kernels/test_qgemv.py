"""duplex.kernels.cpu_qgemv (the AVX512-VNNI quantized matmul) against two references: the same
arithmetic done in torch (activations rounded to int8 per group of 32, then exact integer
dot products; int4's zero points times the exact sum of x), which it must match to fp32 rounding, and the plain fp32 product of the
dequantized weight, which it may differ from only by that activation rounding."""
from __future__ import annotations

import pytest
import torch

from duplex.kernels import cpu_qgemv, quant
from duplex.kernels.quant import QuantWeight

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(),
                                reason="no C compiler or no AVX512-VNNI on this CPU")


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: int8 per 32 inputs, dx = amax / 127."""
    groups = x.reshape(x.shape[0], -1, cpu_qgemv.GROUP)
    dx = groups.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return ((groups * inv).round() * dx).reshape(x.shape)


def reference(w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: int4's zero term uses the exact sum of x."""
    xq = quantized_activations(x).double()
    if w.bits == 8:
        return xq @ w.dequantize().double().T
    g = cpu_qgemv.GROUP
    steps = (w.q.double().reshape(w.shape[0], -1, g) - 8) * w.scale.double()[..., None]
    zeros = w.zero.double()[..., None].expand(-1, -1, g)
    return xq @ steps.reshape(w.shape).T + x.double() @ zeros.reshape(w.shape).T


def weights(bits: int, n: int, k: int) -> QuantWeight:
    w = torch.randn(n, k) * 0.05
    return QuantWeight.int4_from_float(w) if bits == 4 else QuantWeight.int8_from_float(w)


def pack(w: QuantWeight) -> cpu_qgemv.Packed:
    return cpu_qgemv.pack_int4(w.q, w.scale, w.zero) if w.bits == 4 \
        else cpu_qgemv.pack_int8(w.q, w.scale)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 13])  # 13: two passes of the kernel's 8-row tile
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (192, 576)])
def test_matches_the_same_arithmetic_in_torch(bits, m, n, k):
    torch.manual_seed(bits * 1000 + m * 10 + n)
    w = weights(bits, n, k)
    x = torch.randn(m, k)
    ref = reference(w, x)
    got = cpu_qgemv.linear(pack(w), x)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_differs_from_fp32_only_by_activation_rounding(bits):
    torch.manual_seed(bits)
    w = weights(bits, 256, 1536)
    x = torch.randn(5, 1536)
    ref = x @ w.dequantize().T
    err = (cpu_qgemv.linear(pack(w), x) - ref).norm() / ref.norm()
    assert 0 < err < 0.012, err  # int8 rounding of 32-wide groups: ~0.5 % measured


def test_strided_rows_zero_rows_and_outliers():
    torch.manual_seed(3)
    w = weights(4, 32, 64)
    base = torch.randn(4, 128)
    x = base[:, :64]  # rows with stride 128, last dim contiguous
    x[1] = 0.0  # an all-zero group must give exactly zero activation, not NaN
    x[2, 5] = 1e4  # an outlier only spoils its own group of 32
    got = cpu_qgemv.linear(pack(w), x)
    ref = reference(w, x.contiguous())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[1], torch.zeros(32), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_quant_weight_runs_it_and_keeps_the_dense_copy_for_big_batches(monkeypatch):
    torch.manual_seed(4)
    w = weights(4, 64, 128)
    w.with_dense = True
    w.pack()
    assert w._vnni is not None
    calls = []
    real = cpu_qgemv.linear
    monkeypatch.setattr(cpu_qgemv, "linear", lambda p, x, *a: calls.append(x.shape[0]) or real(p, x, *a))
    w.linear(torch.randn(2, 128))
    w.linear(torch.randn(quant.MAX_VNNI_ROWS + 1, 128))  # over MAX_VNNI_ROWS: the bf16 copy
    assert calls == [2]


def test_refuses_shapes_it_cannot_tile():
    assert not cpu_qgemv.fits(20, 64) and not cpu_qgemv.fits(32, 48)
    with pytest.raises(AssertionError):
        cpu_qgemv.pack_int4(torch.zeros(20, 64, dtype=torch.uint8), torch.ones(20, 2),
                            torch.zeros(20, 2))


def half_exact(w: QuantWeight) -> QuantWeight:
    """w with its scales and mins (zero - 8 * scale) rounded to IEEE halves and zero = min +
    8 * scale in fp32, as the loader builds a GGUF Q4_1 file's: such weights pack as
    INT4_HALF, which must give bitwise what the fp32-scale layout gives."""
    scale = w.scale.half().float()
    low = (w.zero - 8 * w.scale).half().float()
    return QuantWeight(4, w.q, scale, low + 8 * scale, w.group_size)


@pytest.mark.parametrize("m", [1, 5, 13])
def test_half_scales_match_the_same_arithmetic(m):
    torch.manual_seed(m)
    w = half_exact(weights(4, 96, 192))
    packed = pack(w)
    assert packed.kind == cpu_qgemv.INT4_HALF and packed.scale.dtype == torch.float16
    x = torch.randn(m, 192)
    ref = reference(w, x)
    got = cpu_qgemv.linear(packed, x)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    fp32_layout = cpu_qgemv.Packed(cpu_qgemv.INT4, 96, 192, packed.weight,
                                   cpu_qgemv._per_block(w.scale), cpu_qgemv._per_block(w.zero))
    assert torch.equal(got, cpu_qgemv.linear(fp32_layout, x))


def test_scales_that_are_not_halves_stay_fp32():
    w = weights(4, 32, 64)  # min-max scales of random weights: not halves
    assert pack(w).kind == cpu_qgemv.INT4 and pack(w).scale.dtype == torch.float32

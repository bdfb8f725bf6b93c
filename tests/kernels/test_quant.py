"""Weight-only quantized linears and GGUF block unpacking, each against its reference:
the int4 / int8 kernels against dequantize-then-matmul, the unpacked GGUF integers against
`gguf.dequantize` on the same bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from duplex.engine.models.gguf_quant import unpack_int4, unpack_q8_0
from duplex.kernels import ops, quant
from duplex.kernels.quant import MAX_PACKED_ROWS, QuantEmbedding, QuantWeight, quant_linear_ref

# bf16 activations inside the kernels: a relative error of a few 2^-8 on the output
RTOL, ATOL = 2e-2, 2e-2


def _close(out, ref):
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= RTOL * scale + ATOL, (out - ref).abs().max() / scale


@pytest.mark.parametrize("rows", [1, 3, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 37])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_dense", [False, True])
def test_quant_linear_matches_dequantized_reference(rows, bits, with_dense):
    torch.manual_seed(rows * 10 + bits)
    w = torch.randn(96, 128)
    weight = (QuantWeight.int4_from_float(w, with_dense=with_dense) if bits == 4
              else QuantWeight.int8_from_float(w, with_dense=with_dense))
    dequantized = weight.dequantize()
    x, bias = torch.randn(rows, 128), torch.randn(96)
    out = ops.linear(x, weight, bias)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    _close(out, quant_linear_ref(x, weight, bias, dequantized))
    assert weight.q is None and weight.nbytes > 0  # packed: the unpacked integers are gone


def test_quantization_error_is_bounded_by_the_step():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    int4 = QuantWeight.int4_from_float(w)
    step = int4.scale.repeat_interleave(32, 1)  # one quantization step per element
    assert ((int4.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    int8 = QuantWeight.int8_from_float(w)
    assert ((int8.dequantize() - w).abs() <= int8.scale[:, None] / 2 + 1e-6).all()


def test_cat_fuses_projections_before_packing():
    torch.manual_seed(1)
    a, b = QuantWeight.int4_from_float(torch.randn(32, 64)), \
        QuantWeight.int4_from_float(torch.randn(16, 64))
    fused = ops.concat_weights([a, b])
    assert fused.shape == (48, 64)
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def _gguf_bytes(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """A quantized tensor's raw bytes: by gguf's own quantizer where it has one, else
    random blocks with finite half-precision scales (Q4_K)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    if kind != "Q4_K":
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, size=(rows, cols // 256, 2)).astype(np.float16)
    blocks[..., :4] = scales.view(np.uint8).reshape(rows, cols // 256, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_unpacking_equals_gguf_dequantize(kind):
    raw = _gguf_bytes(kind, 8, 512, seed=len(kind))
    reference = dequantize(raw, GGMLQuantizationType[kind]).reshape(8, 512)
    weight = unpack_int4(kind, raw, 512).to_weight()
    # (q - 8) * d + (m + 8 d) rounds once more than d * q + m: a few float32 ulps
    np.testing.assert_allclose(weight.dequantize().numpy(), reference, rtol=0, atol=2e-6)


def test_q8_0_embedding_equals_gguf_dequantize_exactly():
    raw = _gguf_bytes("Q8_0", 40, 96, seed=3)
    reference = dequantize(raw, GGMLQuantizationType.Q8_0).reshape(40, 96)
    table = QuantEmbedding(*unpack_q8_0(raw, 96))
    ids = torch.tensor([0, 39, 7, 7, 12])
    assert torch.equal(ops.embedding(ids, table), torch.from_numpy(reference)[ids])
    assert table.nbytes < reference.nbytes / 3


@pytest.mark.parametrize("rows", [1, 7, 13, 64, 300])
def test_prepacked_dense_copy_computes_the_plain_ones_product(rows):
    """The bf16 dense copy in oneDNN's blocked layout (quant.prepack_dense) computes F.linear's
    product on the plain copy: the same bf16 GEMM, its fp32 sums possibly blocked another
    way, so equal to within the output's bf16 rounding."""
    torch.manual_seed(rows)
    w = (torch.randn(192, 96) * 0.1).to(torch.bfloat16)
    packed = quant.prepack_dense(w)
    if not packed.is_mkldnn:
        pytest.skip("torch without oneDNN: the plain copy is used")
    x = torch.randn(rows, 96).to(torch.bfloat16)
    reference = torch.nn.functional.linear(x.float(), w.float())
    for rows_in in (x, x.t().contiguous().t()):  # a non-contiguous input too
        out = quant.dense_linear(rows_in, packed)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 192)
        torch.testing.assert_close(out.float(), reference, rtol=8e-3, atol=8e-3)


def test_a_weight_with_a_dense_copy_holds_it_prepacked(monkeypatch):
    w = torch.randn(64, 64)
    weight = QuantWeight.int8_from_float(w, with_dense=True).pack()
    # packed wherever oneDNN can pack bf16 on this CPU (not on an AVX2-only one)
    assert weight.dense.is_mkldnn == quant.prepack_dense(w.to(torch.bfloat16)).is_mkldnn
    monkeypatch.setenv("DUPLEX_ONEDNN_PACK", "0")
    plain = QuantWeight.int8_from_float(w, with_dense=True).pack()
    assert not plain.dense.is_mkldnn and plain.nbytes == weight.nbytes
    x = torch.randn(40, 64)  # above the row limits: both run their dense copies
    torch.testing.assert_close(weight.linear(x), plain.linear(x), rtol=8e-3, atol=8e-3)

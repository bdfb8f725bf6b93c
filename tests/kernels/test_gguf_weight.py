"""kernels.cpu_gguf / kernels.gguf_weight: every GGUF type the engine runs with its own bits,
against the `gguf` package's numpy dequantizer on the same bytes and an fp64 matmul, at
decode row counts (the row kernel: block types on int8 activations, so the reference takes
x rounded the same way, written here in torch) and prompt row counts (the tiled GEMM, fp32
x); and fused projections whose parts have different types (quant.FusedWeight). The
prompt GEMM runs in fp32 in these tests unless one says bf16 (gguf_weight.prompt_gemm_dtype:
bf16 on CPUs with AMX-BF16 / AVX512-BF16), whose reference rounds x and w to bf16 first."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from duplex.kernels import cpu_gguf, cpu_qgemv, gguf_weight, ops, quant
from duplex.kernels.gguf_weight import GGUFWeight
from duplex.kernels.quant import FusedWeight, QuantWeight

TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
K_QUANTS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # where their fp16 d fields are


@pytest.fixture(autouse=True)
def fp32_prompt_gemm(monkeypatch):
    monkeypatch.setenv("DUPLEX_PROMPT_GEMM", "fp32")


def raw_rows(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 `[n, row_bytes]`: gguf's own quantizer where it has one; K-quants (which it
    cannot quantize) are random bytes with their fp16 d / dmin set to small values."""
    rng = np.random.default_rng(seed)
    type_id = cpu_gguf.TYPE_IDS[type_name]
    if type_name not in K_QUANTS:
        values = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        data = quantize(values, GGMLQuantizationType(type_id))
        return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(n, -1))
    _, block, nbytes = cpu_gguf.TYPES[type_id]
    blocks = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    d = (rng.random((n, k // block)) * 2e-3).astype(np.float16)
    for start in K_QUANTS[type_name]:
        blocks[..., start:start + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def int8_rounded(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x `[M, K]` as the row kernel sees it: int8 q = round(x * 127 / max|x|) (fp32, half to
    even) with the scale max|x| / 127, per `group` inputs (the K-quants' kernels: 256);
    fp64 `[M, K]` q * scale."""
    q, scale = int8_blocks(x, group)
    return (q.double() * scale.double()).reshape(x.shape)


def int8_blocks(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = x.float().reshape(x.shape[0], -1, group)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax as C divides (a Python number over a tensor is a reciprocal times 127 in
    # torch, one ulp off at times)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    return (blocks * inv).round(), amax / 127


def on_int8_rows(type_name: str, m: int) -> bool:
    """Whether a decode step of m rows takes the row kernel on int8 activations."""
    type_id = cpu_gguf.TYPE_IDS[type_name]
    return cpu_gguf.TYPES[type_id][1] > 1 and m <= gguf_weight.row_limit(type_id)


def reference(type_name: str, raw: torch.Tensor, k: int, x: torch.Tensor,
              int8_x: bool = False) -> torch.Tensor:
    type_id = cpu_gguf.TYPE_IDS[type_name]
    w = cpu_gguf.reference_dequant(type_id, raw, k)
    return (int8_rounded(x, cpu_gguf.x_group(type_id)) if int8_x else x.double()) @ w.double().T


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("type_name", TYPES)
def test_dequant_is_bitwise_gguf(type_name):
    k = 512
    raw = raw_rows(type_name, 21, k)
    type_id = cpu_gguf.TYPE_IDS[type_name]
    assert torch.equal(cpu_gguf.dequant(type_id, raw, k), cpu_gguf.reference_dequant(type_id, raw, k))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 37, 130])  # decode rows (row kernel), prompt rows (tiles)
def test_linear_matches_dequantized_fp32(type_name, m, monkeypatch):
    monkeypatch.setattr(gguf_weight, "TILE_BYTES", 4 * 768 * 16)  # 16-row tiles: several
    n, k = 67, 768  # odd N; K three K-quant blocks
    raw = raw_rows(type_name, n, k, seed=m)
    w = GGUFWeight(cpu_gguf.TYPE_IDS[type_name], raw, k, with_dense=False)
    x = torch.randn(m, k)
    out = ops.linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32 and w.dense is None
    assert_close(out, reference(type_name, raw, k, x, on_int8_rows(type_name, m)))


def test_int8_activations():
    """The C library's rounding is the reference's (round half to even, a zero block stays
    zero), and what it costs against fp32 inputs is int8's rounding, about 0.5 %."""
    x = torch.randn(3, 256) * torch.logspace(-3, 2, 256)
    x[1, 32:64] = 0
    for group in (32, 256):  # the K-quants' kernels take one scale per 256 inputs
        xq, dx, xs = cpu_gguf.quantize_x(x, group)
        q, scale = int8_blocks(x, group)
        assert torch.equal(xq.reshape(3, -1, group).float(), q)
        assert torch.equal(dx, scale[..., 0])
        assert torch.equal(xs, xq.reshape(3, -1, 16).sum(-1, dtype=torch.int32))
    raw = raw_rows("Q4_K", 64, 256)
    x = torch.randn(2, 256)
    full = reference("Q4_K", raw, 256, x)
    err = (cpu_gguf.linear(cpu_gguf.TYPE_IDS["Q4_K"], raw, 256, x).double() - full).norm()
    assert err / full.norm() < 2e-2


@pytest.mark.parametrize("int8_prompt", ["auto", "1", "0"])
@pytest.mark.parametrize("type_name", ["Q5_0", "Q6_K"])
def test_prompt_step_takes_one_path_at_any_row_count(type_name, int8_prompt, monkeypatch):
    """A prompt step's rows take one kernel whatever their count, so a prompt's numbers do
    not depend on how much of it came from the cache: K-quants' kernel with weight rows in
    the lanes on AVX-512 VNNI without AMX (at every row count, fewer than its decode-step
    minimum too) unless DUPLEX_INT8_PROMPT=0, and with =1 the int8 row kernel on a CPU
    without VNNI; else the fp32 (or bf16) tiles."""
    monkeypatch.setenv("DUPLEX_INT8_PROMPT", int8_prompt)
    k = 256
    raw = raw_rows(type_name, 32, k)
    w = GGUFWeight(cpu_gguf.TYPE_IDS[type_name], raw, k, with_dense=False)
    lanes = type_name == "Q6_K" and cpu_gguf.lanes_available() and not cpu_gguf.amx_available()
    int8 = (int8_prompt != "0" and lanes) or (int8_prompt == "1" and not cpu_qgemv.available())
    assert w.int8_prompt() == int8
    assert (w.dense_from_rows() is None) == (int8 or gguf_weight.prompt_gemm_dtype() == torch.float32)
    x = torch.randn(70, k)  # above the decode row kernel's limit
    with quant.prompt_step():
        many, two = ops.linear(x, w), ops.linear(x[:2], w)
    assert torch.equal(two, many[:2])  # bitwise, row by row
    if int8:
        assert torch.equal(many, cpu_gguf.linear(w.type_id, raw, k, x, lanes=lanes))
    else:
        assert torch.equal(many, w._tiled(x))
    assert_close(many, reference(type_name, raw, k, x, int8_x=int8))


@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
def test_a_prompt_rows_numbers_do_not_depend_on_the_rows_beside_it(gemm, monkeypatch):
    """The tiled path (every prompt step) gives each row the same bits whether it comes alone,
    as a prefix-cache hit's few new tokens, or inside a long prompt."""
    monkeypatch.setenv("DUPLEX_PROMPT_GEMM", gemm)
    k = 576
    w = GGUFWeight(cpu_gguf.TYPE_IDS["Q4_1"], raw_rows("Q4_1", 1536, k), k, with_dense=False)
    x = torch.randn(300, k)
    full = w._tiled(x)
    for start, end in ((0, 1), (16, 21), (3, 9), (7, 71), (3, 300)):
        assert torch.equal(w._tiled(x[start:end].contiguous()), full[start:end]), (start, end)


@pytest.mark.parametrize("type_name", TYPES)
def test_bf16_dequant_is_the_fp32_weights_rounded(type_name):
    """The bf16 tiles are exactly the fp32 dequantization rounded to nearest even (the C
    library's AVX512-BF16 path where the CPU has it, its integer rounding elsewhere)."""
    k = 300 if type_name in ("F16", "BF16") else 512  # float rows: not a multiple of 256
    raw = raw_rows(type_name, 21, k, seed=5)
    type_id = cpu_gguf.TYPE_IDS[type_name]
    fp32 = cpu_gguf.dequant(type_id, raw, k)
    bf16 = cpu_gguf.dequant(type_id, raw, k, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [37, 130])
def test_bf16_prompt_gemm_matches_the_bf16_reference(type_name, m, monkeypatch):
    """DUPLEX_PROMPT_GEMM=bf16 (the default on AMX / AVX512-BF16 CPUs): x and the weights
    rounded to bf16, fp32 sums, a bf16 result; the weight in several chunks (K-quants: with
    their int8 prompts off, the default on AVX-512 VNNI without AMX)."""
    monkeypatch.setenv("DUPLEX_PROMPT_GEMM", "bf16")
    monkeypatch.setenv("DUPLEX_INT8_PROMPT", "0")
    monkeypatch.setattr(gguf_weight, "BF16_CHUNK", 16 * 768)  # 16-row chunks, odd last one
    n, k = 67, 768
    raw = raw_rows(type_name, n, k, seed=m)
    w = GGUFWeight(cpu_gguf.TYPE_IDS[type_name], raw, k, with_dense=False)
    x = torch.randn(m, k)
    with quant.prompt_step():
        out = ops.linear(x, w)
    w_ref = cpu_gguf.reference_dequant(w.type_id, raw, k).to(torch.bfloat16).double()
    ref = x.to(torch.bfloat16).double() @ w_ref.T
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())
    with quant.prompt_step():  # rows alone or beside others: the same bits
        assert torch.equal(ops.linear(x[3:5], w), out[3:5])


def test_an_output_head_never_takes_a_bf16_gemm(monkeypatch):
    """A head's logits stay fp32 sums of fp32 products: a bf16 output would round a logit of
    20 to a multiple of 1/8 and settle greedy near-ties by rounding."""
    monkeypatch.setenv("DUPLEX_PROMPT_GEMM", "bf16")
    k = 256
    raw = raw_rows("Q8_0", 80, k)
    head = GGUFWeight(cpu_gguf.TYPE_IDS["Q8_0"], raw, k, with_dense=False)
    head.fp32_out = True
    x = torch.randn(70, k) * 4
    with quant.prompt_step():
        out = ops.linear(x, head)
    assert head.dense_from_rows() is None  # no bf16 stream after it either
    assert_close(out, reference("Q8_0", raw, k, x))


@pytest.mark.parametrize("choice, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_prompt_gemm_dtype_switch(choice, dtype, monkeypatch):
    monkeypatch.setenv("DUPLEX_PROMPT_GEMM", choice)
    assert gguf_weight.prompt_gemm_dtype() == dtype
    monkeypatch.setenv("DUPLEX_PROMPT_GEMM", "fp16")
    with pytest.raises(ValueError, match="fp32 or bf16"):
        gguf_weight.prompt_gemm_dtype()
    monkeypatch.delenv("DUPLEX_PROMPT_GEMM")
    flags = gguf_weight.cpu_flags()
    hardware = b" amx_bf16" in flags or b" avx512_bf16" in flags
    assert gguf_weight.prompt_gemm_dtype() == (torch.bfloat16 if hardware else torch.float32)


def test_bias_out_dtype_and_leading_dims():
    k = 64
    raw = raw_rows("Q8_0", 48, k)
    w = GGUFWeight(cpu_gguf.TYPE_IDS["Q8_0"], raw, k, with_dense=False)
    x, bias = torch.randn(2, 5, k), torch.randn(48)
    out = ops.linear(x, w, bias, out_dtype=torch.bfloat16)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    ref = reference("Q8_0", raw, k, x.reshape(-1, k), int8_x=on_int8_rows("Q8_0", 10)  # the path
                    ).reshape(2, 5, 48) + bias.double()  # its 10 rows take
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_dense_copy_is_opt_in(monkeypatch):
    k = 256
    raw = raw_rows("Q4_K", 32, k)
    assert GGUFWeight(cpu_gguf.TYPE_IDS["Q4_K"], raw, k).pack().dense is None
    monkeypatch.setenv("DUPLEX_DENSE_WEIGHTS", "1")
    w = GGUFWeight(cpu_gguf.TYPE_IDS["Q4_K"], raw, k).pack()
    assert w.dense is not None and w.nbytes == raw.numel() + 32 * k * 2
    x = torch.randn(gguf_weight.row_limit(cpu_gguf.TYPE_IDS["Q4_K"]) + 1, k)
    ref = reference("Q4_K", raw, k, x)
    err = (ops.linear(x, w).double() - ref).norm() / ref.norm()
    assert err < 1e-2, err  # bf16 weights and inputs: ~0.4 % expected


def test_same_type_parts_fuse_into_one_weight():
    k = 256
    parts = [GGUFWeight(cpu_gguf.TYPE_IDS["Q5_K"], raw_rows("Q5_K", n, k, seed=n), k,
                        with_dense=False) for n in (32, 16, 16)]
    fused = ops.concat_weights(parts)
    assert type(fused) is GGUFWeight and fused.shape == (64, k)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


@pytest.mark.parametrize("m", [1, 3, 37])
def test_mixed_types_in_one_fused_projection(m):
    """q, k as Q4_K and v as Q6_K (what llama.cpp's Q4_K_M writes), plus an int4
    QuantWeight and a float part: one fused weight, each part with its own kernel."""
    k = 256
    q = GGUFWeight(cpu_gguf.TYPE_IDS["Q4_K"], raw_rows("Q4_K", 64, k, 1), k, with_dense=False)
    kk = GGUFWeight(cpu_gguf.TYPE_IDS["Q4_K"], raw_rows("Q4_K", 32, k, 2), k, with_dense=False)
    v = GGUFWeight(cpu_gguf.TYPE_IDS["Q6_K"], raw_rows("Q6_K", 32, k, 3), k, with_dense=False)
    int4 = QuantWeight.int4_from_float(torch.randn(16, k) * 0.05)
    dense = torch.randn(8, k) * 0.05
    fused = ops.concat_weights([q, kk, v, int4, dense])
    assert isinstance(fused, FusedWeight) and fused.shape == (152, k)
    # a float part has no bf16 GEMM from any row count: no stream through this one
    assert fused.vnni_layout() is None and fused.dense_from_rows() is None
    gguf_only = ops.concat_weights([q, kk, v])  # Q4_K_M's q/k/v: the most of the parts'
    assert isinstance(gguf_only, FusedWeight) and gguf_only.dense_from_rows() == (
        None if q.dense_from_rows() is None else max(p.dense_from_rows() for p in (q, kk, v)))
    torch.manual_seed(m)
    x, bias = torch.randn(m, k), torch.randn(152)
    out = ops.linear(x, fused, bias)
    assert out.shape == (m, 152)
    gguf_parts = torch.cat([q.dequantize(), kk.dequantize(), v.dequantize()]).double()
    xr = int8_rounded(x, 256) if on_int8_rows("Q4_K", m) else x.double()
    assert_close(out[:, :128], xr @ gguf_parts.T + bias[:128].double())
    # the int4 part is its own kernel's (bf16 activations where torch's kernel runs)
    assert torch.equal(out[:, 128:144], int4.linear(x) + bias[128:144])
    assert_close(out[:, 144:], x.double() @ dense.double().T + bias[144:].double())


def test_refuses_rows_of_the_wrong_size():
    with pytest.raises(AssertionError, match="bytes a row"):
        GGUFWeight(cpu_gguf.TYPE_IDS["Q4_0"], torch.zeros(4, 17, dtype=torch.uint8), 32)
    with pytest.raises(AssertionError, match="divisible by 256"):
        cpu_gguf.row_bytes(cpu_gguf.TYPE_IDS["Q6_K"], 300)

"""duplex.bench.gguf_linears on a tiny GGUF the test writes: it finds the layer's weights with
their shapes, runs every path this CPU has at each row count, and the paths it times compute
the same product (the kernels' own correctness is tests/kernels/test_cpu_gguf*.py)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from duplex.bench import gguf_linears
from duplex.kernels import cpu_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    q8 = gguf.quants.quantize(rng.standard_normal((48, 256)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((64, 96)).astype(np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))
    writer.add_tensor("blk.1.attn_q.weight", rng.standard_normal((16, 32)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_layer_weights_are_the_layers_2d_tensors(tiny):
    found = gguf_linears.layer_weights(str(tiny), 0)
    assert [(name, cpu_gguf.TYPES[t][0], tuple(raw.shape), k) for name, t, raw, k in found] == [
        ("blk.0.attn_q.weight", "Q8_0", (48, 8 * 34), 256),
        ("blk.0.ffn_down.weight", "F16", (64, 96 * 2), 96)]
    with pytest.raises(SystemExit, match="no 2-D weights"):
        gguf_linears.layer_weights(str(tiny), 5)


def test_every_path_runs_and_reports(tiny, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    gguf_linears.add_arguments(parser)
    out = tmp_path / "g.json"
    args = parser.parse_args([str(tiny), "--rows", "1,17", "--rounds", "2", "--out", str(out)])
    assert gguf_linears.run(args) == 0
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"1", "17"}
    expected = {"prompt"} | ({"int8-rows"} if cpu_gguf.available() else set()) | (
        {"prompt-onednn"} if cpu_gguf.bf16_gemm_kind() else set())
    macs = 48 * 256 + 64 * 96  # the layer's two linears, n k each
    for m in ("1", "17"):
        assert set(result["ms"][m]) == expected and all(v > 0 for v in result["ms"][m].values())
        for name, ms in result["ms"][m].items():  # G op/s: 2 m n k over the time
            assert result["gops"][m][name] == pytest.approx(2 * int(m) * macs / ms / 1e6)
    printed = capsys.readouterr().out
    assert "rows    17" in printed
    # the int8 rows' limit only for a layer of K-quants (VNNI) or of block types (AVX2): this
    # one is Q8_0 and F16; the prompt's for the AVX512-BF16 GEMM or AVX2's fp32 tiles
    fp32_tiles = gguf_linears.avx2_only() and cpu_gguf.available()
    assert set(result["peak_gops"]) == (
        {"prompt"} if cpu_gguf.bf16_gemm_kind() == "avx512" or fp32_tiles else set())
    assert ("CPU limit" in printed) == bool(result["peak_gops"])


@pytest.mark.skipif(cpu_gguf.bf16_gemm_kind() is None, reason="no bf16 GEMM on the blocks here")
def test_the_prompt_paths_compute_the_same_product(tiny):
    """The bf16 GEMM on the blocks and oneDNN on the dequantized chunks: the same weights and
    rows, so the same result up to bf16 rounding and summation order."""
    from duplex.kernels.gguf_weight import GGUFWeight

    (_, type_id, raw, k), _ = gguf_linears.layer_weights(str(tiny), 0)
    w = GGUFWeight(type_id, raw, k)
    x = torch.randn(17, k)
    blocks = w._tiled(x).float()
    lib = cpu_gguf._load()
    for name in ("gg_set_amx", "gg_set_bf16_gemm"):
        if hasattr(lib, name):
            getattr(lib, name)(0)
    try:
        assert cpu_gguf.bf16_gemm_kind() is None
        chunks = w._tiled(x).float()
    finally:
        cpu_gguf.apply_amx_switch(lib)
    ref = x.bfloat16().double() @ w.dequantize().bfloat16().double().T
    for got in (blocks, chunks):
        assert torch.allclose(got.double(), ref, rtol=2 ** -7, atol=1e-2 * ref.abs().max().item())


@pytest.mark.skipif(not cpu_gguf.available(), reason="no C compiler for the GGUF kernels")
def test_peak_probe_counts_its_operations():
    """gg_peak's rate is its instruction count times the operations of one, over the time:
    a miscount by a factor (or a loop the compiler dropped) leaves the bounds a 2-core box
    can reach, 1 G/s to 2 instructions a cycle at 6 GHz on every thread."""
    for kind, ops in (("bf16", 64), ("int8", 128), ("int8-256", 64), ("fp32-256", 16),
                      ("int8-avx2", 64)):
        rate = cpu_gguf.peak_ops(kind, 1, iters=200_000)
        built = kind != "bf16" or cpu_gguf.bf16_gemm_kind() == "avx512" or (
            cpu_gguf.bf16_gemm_kind() == "amx")
        if rate is None:
            assert not (kind == "int8" and cpu_gguf.vn_available())
            assert not (kind in ("fp32-256", "int8-avx2") and gguf_linears.avx2_only())
            continue
        assert built and 1e9 <= rate <= 2 * 6e9 * ops
    with pytest.raises(KeyError):
        cpu_gguf.peak_ops("fp64", 1)


def test_int8_rows_limit_only_for_a_layer_of_k_quants():
    """With AVX-512 VNNI the lanes kernel's limit applies to a layer of K-quants only; on an
    AVX2-only CPU every block type's rows are AVX2's int8 dot, and the prompt tiles fp32 FMAs."""
    q4_k, q8_0 = cpu_gguf.TYPE_IDS["Q4_K"], cpu_gguf.TYPE_IDS["Q8_0"]
    lanes = cpu_gguf.vn_available() and not cpu_gguf.amx_available()
    avx2 = gguf_linears.avx2_only() and cpu_gguf.available()
    k_quants = gguf_linears.peaks(1, [("a", q4_k, None, 256)], tries=1)
    mixed = gguf_linears.peaks(1, [("a", q4_k, None, 256), ("b", q8_0, None, 256)], tries=1)
    assert ("int8-rows" in k_quants) == (lanes or avx2)
    assert ("int8-rows" in mixed) == avx2
    if avx2:
        assert "prompt" in k_quants  # fp32 tiles: DUPLEX_PROMPT_GEMM is not set in the tests
    assert all(rate > 0 for rate in k_quants.values())

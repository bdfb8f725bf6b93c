"""Quantized weights on the default GGUF (Q4_1 layers, Q8_0 embedding): the engine's output
in `auto` mode against the exact float32 mode, at the rates the README states, through
both of its paths (the int4 kernel — VNNI where the CPU has it — for small batches, the
bf16 copy for large ones)."""
from __future__ import annotations

import pytest
import torch

from duplex.bench.quality import measure
from duplex.engine.config import EngineConfig
from duplex.engine.core import EngineCore
from duplex.kernels import quant
from duplex.kernels.quant import QuantEmbedding, QuantWeight
from tests.engine.conftest import make_core

# stated in README.md ("Weight precision"); measured by `duplex bench quality`
MIN_TOP1 = {"auto": 0.95, "int8": 0.94, "float32:bfloat16": 0.97}
MAX_PERPLEXITY_RATIO = 1.01


@pytest.mark.slow
@pytest.mark.parametrize("packed_rows", [0, 10**9], ids=["bf16-copy", "int4-kernel"])
def test_auto_agrees_with_float32_at_the_stated_rate(default_model, monkeypatch, packed_rows):
    monkeypatch.setattr(quant, "MAX_PACKED_ROWS", packed_rows)
    monkeypatch.setattr(quant, "MAX_VNNI_ROWS", packed_rows)
    fp32, auto, int8, kv16 = measure(default_model, ["float32", "auto", "int8", "float32:bfloat16"])
    assert fp32.top1_agreement == 1.0
    for q in (auto, int8, kv16):  # kv16: exact weights, only the KV cache rounded to bf16
        assert q.top1_agreement >= MIN_TOP1[q.dtype], q
        assert q.perplexity <= fp32.perplexity * MAX_PERPLEXITY_RATIO, q
    assert auto.weight_bytes < fp32.weight_bytes and int8.weight_bytes < fp32.weight_bytes / 2


def test_auto_keeps_the_files_bits(default_model):
    core = make_core(default_model, weights_dtype="auto", num_kv_blocks=64)
    layer = core.model.layers[0]
    assert isinstance(layer.attn.qkv_weight, QuantWeight) and layer.attn.qkv_weight.bits == 4
    assert isinstance(layer.mlp.down_weight, QuantWeight)
    assert isinstance(core.model.embed, QuantEmbedding)  # Q8_0 rows, dequantized on lookup
    assert isinstance(core.model.lm_head, QuantWeight) and core.model.lm_head.bits == 8
    assert core.dtype == torch.float32  # activations stay fp32; the KV cache is bf16
    assert core.kv_dtype == core.runner.kv.dtype == torch.bfloat16


def test_int4_with_batch_invariant_is_refused():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig.of(weights_dtype="int4", batch_invariant=True)


def test_auto_under_batch_invariant_runs_float32(default_model):
    core = EngineCore(EngineConfig.of(model=default_model, batch_invariant=True, num_kv_blocks=32),
                      progress=False)
    assert core.quant == "none" and not isinstance(core.model.layers[0].attn.qkv_weight,
                                                   QuantWeight)

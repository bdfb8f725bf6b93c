"""Quantized weights on the default GGUF (Q4_1 layers, Q8_0 embedding): the engine's output
in `auto` mode against the exact float32 mode, at the rates the README states, through
both of its paths (the row kernels - VNNI where the CPU has it - for small batches, the
tiled dequantize-and-GEMM for large ones; no dense bf16 copy by default); and a tiny llama
whose layers mix GGUF types as llama.cpp's Q4_K_M does, against its dequantized self."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from duplex.bench.quality import measure
from duplex.engine.config import EngineConfig
from duplex.engine.core import EngineCore
from duplex.kernels import cpu_gguf, gguf_weight, quant
from duplex.engine.sampling_params import SamplingParams
from duplex.kernels.gguf_weight import GGUFWeight
from duplex.kernels.quant import FusedWeight, QuantWeight
from tests.engine.conftest import make_core, run_engine

# stated in README.md ("Weight precision"); measured by `duplex bench quality`
MIN_TOP1 = {"auto": 0.95, "int8": 0.94, "float32:bfloat16": 0.97}
MAX_PERPLEXITY_RATIO = 1.01


@pytest.mark.slow
@pytest.mark.parametrize("packed_rows", [0, 10**9], ids=["tiled-gemm", "row-kernels"])
def test_auto_agrees_with_float32_at_the_stated_rate(default_model, monkeypatch, packed_rows):
    monkeypatch.setattr(quant, "MAX_PACKED_ROWS", packed_rows)
    monkeypatch.setattr(quant, "MAX_VNNI_ROWS", packed_rows)
    monkeypatch.setattr(gguf_weight, "GEMV_ROWS", packed_rows)
    # kv16 (exact weights, only the KV cache rounded to bf16) takes no kernel path of its
    # own: measured once
    dtypes = ["float32", "auto", "int8"] + (["float32:bfloat16"] if packed_rows == 0 else [])
    fp32, auto, int8, *kv16 = measure(default_model, dtypes)
    assert fp32.top1_agreement == 1.0
    for q in (auto, int8, *kv16):
        assert q.top1_agreement >= MIN_TOP1[q.dtype], q
        assert q.perplexity <= fp32.perplexity * MAX_PERPLEXITY_RATIO, q
    assert auto.weight_bytes < fp32.weight_bytes and int8.weight_bytes < fp32.weight_bytes / 2


def test_the_vnni_layout_is_built_for_small_files_only(monkeypatch):
    """Its bytes pay at SmolLM2's size, not at 1B's (engine/models/gguf_quant.vnni_layouts)."""
    import gguf
    from gguf.quants import quantize

    from duplex.engine.models import gguf_quant
    from duplex.kernels import cpu_qgemv

    monkeypatch.setenv("DUPLEX_GGUF_VNNI", "")
    assert gguf_quant.vnni_layouts(92 << 20) and not gguf_quant.vnni_layouts(636 << 20)
    monkeypatch.setenv("DUPLEX_GGUF_VNNI", "1")
    assert gguf_quant.vnni_layouts(5 << 30)
    monkeypatch.setenv("DUPLEX_GGUF_VNNI", "0")
    assert not gguf_quant.vnni_layouts(1)
    raw = quantize((np.random.default_rng(0).standard_normal((32, 256)) * 0.05).astype(np.float32),
                   gguf.GGMLQuantizationType.Q4_0)
    for vnni in (True, False):
        w = gguf_quant.gguf_weight("Q4_0", raw, 256, lambda rows: rows, vnni).pack()
        assert (w.vnni_layout() is not None) == (vnni and cpu_qgemv.available())


def test_the_gguf_head_keeps_fp32_logits(default_model):
    """The tied Q8_0 head is marked (kernels.gguf_weight.GGUFWeight.fp32_out): its logits
    never come from a bf16 GEMM, so the README's answer stands on every CPU."""
    core = make_core(default_model, weights_dtype="auto", num_kv_blocks=16)
    head = core.model.lm_head
    assert isinstance(head, GGUFWeight) and head.fp32_out and head is core.model.embed


def test_auto_keeps_the_files_bits(default_model):
    core = make_core(default_model, weights_dtype="auto", num_kv_blocks=64)
    layer = core.model.layers[0]
    assert isinstance(layer.attn.qkv_weight, GGUFWeight) and layer.attn.qkv_weight.bits == 4
    assert layer.attn.qkv_weight.type_name == "Q4_1" and layer.attn.qkv_weight.dense is None
    assert isinstance(layer.mlp.down_weight, QuantWeight)
    # the Q8_0 table's own blocks, rows dequantized on lookup, and the tied head is that
    # same object: the table's bytes are held once
    assert isinstance(core.model.embed, GGUFWeight) and core.model.embed.type_name == "Q8_0"
    assert core.model.lm_head is core.model.embed and core.model.embed.dense is None
    assert core.model.embed.dtype == torch.float32
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


# ---------------------------------------------------------------------- mixed GGUF types
# A tiny llama whose layers mix types the way llama.cpp's Q4_K_M does (attn_v and ffn_down in
# Q6_K beside 4-bit q / k): GGUF tensor name suffix -> type.
MIXED_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q6_K", "attn_output": "Q4_1",
               "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "output": "Q5_K"}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 256, 4, 2, 64, 256, 2, 256


def k_quant_bytes(rows: int, cols: int, type_name: str, rng, d: float) -> np.ndarray:
    """Valid Q5_K / Q6_K rows that `gguf` cannot quantize: random bytes, fp16 d (and dmin)."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    d = np.full((rows, cols // block), d, dtype=np.float16).view(np.uint8)
    for start in ((208,) if type_name == "Q6_K" else (0, 2)):
        blocks[..., start:start + 2] = d.reshape(rows, cols // block, 2)
    return blocks.reshape(rows, -1)


def write_mixed_llama(path) -> None:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"context_length": 256, "embedding_length": HIDDEN, "block_count": LAYERS,
                       "feed_forward_length": INTER, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS, "vocab_size": VOCAB}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    tensors = {"token_embd.weight": (rng.standard_normal((VOCAB, HIDDEN)) * 0.5, "F32"),
               "output_norm.weight": (1 + rng.standard_normal(HIDDEN) * 0.1, "F32"),
               "output.weight": ((VOCAB, HIDDEN), MIXED_TYPES["output"])}
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (1 + rng.standard_normal(HIDDEN) * 0.1, "F32")
        for part, shape in shapes.items():
            tensors[f"blk.{i}.{part}.weight"] = (shape, MIXED_TYPES[part])
    for name, (value, type_name) in tensors.items():
        kind = gguf.GGMLQuantizationType[type_name]
        if type_name == "F32":
            writer.add_tensor(name, np.asarray(value, dtype=np.float32))
        elif type_name in ("Q5_K", "Q6_K"):
            d = 3e-4 if name == "output.weight" else 1e-5  # logits far from ties
            writer.add_tensor(name, k_quant_bytes(*value, type_name, rng, d), raw_dtype=kind)
        else:
            w = (rng.standard_normal(value) * 0.05).astype(np.float32)
            writer.add_tensor(name, quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mixed_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mixed") / "mixed-q4_k_m-like.gguf"
    write_mixed_llama(path)
    return str(path)


def test_mixed_types_run_with_their_own_bits_and_match_the_dequantized_model(mixed_llama):
    auto = make_core(mixed_llama, weights_dtype="auto", kv_cache_dtype="float32", num_kv_blocks=32)
    layer = auto.model.layers[0]
    assert isinstance(layer.attn.qkv_weight, FusedWeight)  # Q4_0 q, k + Q6_K v
    assert isinstance(layer.mlp.gate_up_weight, FusedWeight)  # Q5_0 gate + Q8_0 up
    assert isinstance(layer.mlp.down_weight, GGUFWeight) and layer.mlp.down_weight.bits == 6
    assert isinstance(auto.model.lm_head, GGUFWeight) and auto.model.lm_head.type_name == "Q5_K"
    assert all(w.dense is None for w in (layer.attn.o_weight, layer.mlp.down_weight))
    exact = make_core(mixed_llama, weights_dtype="float32", num_kv_blocks=32)
    prompts = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (5, 23)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    got, want = run_engine(auto, prompts, params), run_engine(exact, prompts, params)
    for req in want:
        assert got[req][0] == want[req][0]
        logprobs, reference = torch.tensor(got[req][1]), torch.tensor(want[req][1])
        # the prompt step: fp32 tiles, sums in other orders (bf16 weights and activations
        # where the CPU multiplies bf16, about 0.4 % of each dot product; where prompts take
        # the row kernel, CPUs without VNNI, its int8 activations as decode steps); decode
        # steps: the row kernel's int8 activations (about 1 % of each dot product)
        bf16 = gguf_weight.prompt_gemm_dtype() == torch.bfloat16
        first = 5e-2 if layer.mlp.down_weight.int8_prompt() else 1e-2 if bf16 else 1e-4
        torch.testing.assert_close(logprobs[0], reference[0], rtol=0, atol=first)
        torch.testing.assert_close(logprobs[1:], reference[1:], rtol=0, atol=5e-2)


@pytest.mark.parametrize("mode", ["auto", "0"])
def test_int8_prompts_are_said_once_per_type(mode, caplog, monkeypatch):
    """Where a type's prompt steps take int8 activations (by default: K-quants on AVX-512
    VNNI without AMX), loading says so once; with DUPLEX_INT8_PROMPT=0 it never does."""
    from duplex.engine.models import gguf_quant

    monkeypatch.setenv("DUPLEX_INT8_PROMPT", mode)
    gguf_quant._said.discard(("int8 prompts", "Q6_K"))
    with caplog.at_level("INFO", logger="duplex.engine"):
        weights = [gguf_quant.quantized_linear("Q6_K", np.zeros((16, 210), np.uint8), 256,
                                               lambda r: r, "auto", torch.float32)
                   for _ in range(2)]
    said = [r.message for r in caplog.records if "int8 activations" in r.message]
    int8 = weights[0].int8_prompt()
    assert int8 == (mode == "auto" and cpu_gguf.lanes_available() and not cpu_gguf.amx_available())
    assert said == ([f"GGUF Q6_K prompt steps take int8 activations here, as decode steps do "
                     f"(DUPLEX_INT8_PROMPT={mode}; 0: the bf16 or fp32 GEMM)"] if int8 else [])


def test_types_without_a_kernel_are_dequantized_and_said_once(caplog):
    from duplex.engine.models import gguf_quant

    gguf_quant._said.discard(("dequantized", "Q3_K"))
    raw = np.zeros((4, 110), dtype=np.uint8)  # Q3_K: 110 bytes per 256 weights
    with caplog.at_level("INFO", logger="duplex.engine"):
        for _ in range(2):
            assert gguf_quant.quantized_linear("Q3_K", raw, 256, lambda r: r, "auto",
                                               torch.float32) is None
    said = [r.message for r in caplog.records if "Q3_K" in r.message]
    assert said == ["GGUF Q3_K weights have no kernel here: dequantized to torch.float32"]
    weight = gguf_quant.quantized_linear("Q6_K", np.zeros((16, 210), np.uint8), 256,
                                         lambda r: r, "auto", torch.float32)
    assert isinstance(weight, GGUFWeight) and weight.type_name == "Q6_K"

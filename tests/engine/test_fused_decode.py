"""The one-call decode step (kernels/cpu_decode.c) against the per-op path it replaces: the
same kernels in the same order, so greedy tokens and their logprobs must be bitwise equal,
on the default GGUF in `auto` mode, for decode-only steps of 1..3 rows and mixed steps
(which keep the per-op path)."""
from __future__ import annotations

import functools

import pytest
import torch

from duplex.engine.sampling_params import SamplingParams
from duplex.engine import core as core_module
from duplex.engine.models import loader
from duplex.engine.models.llama import stream_rows
from duplex.kernels import cpu_decode
from duplex.kernels.cpu_decode import DecodeStack
from tests.engine.conftest import make_core, run_engine

pytestmark = pytest.mark.skipif(not cpu_decode.available(),
                                reason="no C compiler, or neither AVX2 nor AVX512 on this CPU")


def _run(core, monkeypatch, flag: str):
    monkeypatch.setenv("DUPLEX_FUSED_DECODE", flag)
    prompts = [list(range(100, 140)), list(range(200, 213)), list(range(300, 370))]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    return run_engine(core, prompts, params, arrivals=[0, 3, 5])


@pytest.mark.parametrize("kv_dtype, element", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_fused_decode_equals_the_per_op_path(default_model, monkeypatch, kv_dtype, element):
    """With a bf16 cache (auto's) the C step rounds k and v to bf16 as torch's store does."""
    calls = []
    forward = DecodeStack.forward
    monkeypatch.setattr(DecodeStack, "forward",
                        lambda self, h, *a: calls.append(h.shape[0]) or forward(self, h, *a))
    core = make_core(default_model, weights_dtype="auto", kv_cache_dtype=kv_dtype,
                     num_kv_blocks=128)
    assert core.runner.kv.dtype == element
    per_op = _run(core, monkeypatch, "0")
    assert calls == [] and core.model._decode_stack is None
    core = make_core(default_model, weights_dtype="auto", kv_cache_dtype=kv_dtype,
                     num_kv_blocks=128)  # no prefix hits
    fused = _run(core, monkeypatch, "1")
    assert isinstance(core.model._decode_stack, DecodeStack)
    assert set(calls) == {1, 2, 3}  # batch 1 before the second arrival, then 2 and 3
    assert fused == per_op  # tokens and logprobs, bitwise


def test_float32_mode_never_takes_it(default_model, monkeypatch):
    core = make_core(default_model, num_kv_blocks=64)  # exact mode: no fused kernels
    _run(core, monkeypatch, "1")
    assert core.model._decode_stack is None


@pytest.mark.parametrize("kv_dtype", ["auto", "float32"])
@pytest.mark.parametrize("switch", ["DUPLEX_DENSE_WEIGHTS=1", "DUPLEX_PROMPT_GEMM=bf16"],
                         ids=["dense-copies", "bf16-chunks"])
def test_bf16_matmul_stream_equals_the_fp32_activations_path(default_model, monkeypatch,
                                                             kv_dtype, switch):
    """Steps whose matmuls all run through a bf16 GEMM (prefill, decode batches above the
    few-row kernels' rows), on the bf16 dense copies or on the weights dequantized to bf16
    per call (the AMX / AVX512-BF16 default), hand the bf16 outputs straight to the fused
    kernels (engine/models/llama.py `_gemm_stream`); the roundings are the same ones, so
    tokens and logprobs are bitwise those of the path that converts to fp32 and back."""
    from duplex.kernels import cpu_fused, quant
    monkeypatch.setattr(quant, "MAX_VNNI_ROWS", 12)  # the AMX CPUs' value: fewer prompts
    monkeypatch.setenv(*switch.split("="))
    # one load for this test's cores (the suite's shared load has no copies, and its model
    # remembers whether it streams)
    monkeypatch.setattr(core_module, "load", functools.lru_cache(maxsize=1)(loader.load))
    calls = []
    fused = cpu_fused.rope_store_kv
    monkeypatch.setattr(cpu_fused, "rope_store_kv",
                        lambda qkv, *a: calls.append(qkv.shape[0]) or fused(qkv, *a))
    # short prompts, two decode steps: the bf16 GEMM is torch's slow fallback on CPUs
    # without bf16 instructions (an AVX2 Zen 1: 58 s a case with 8-24-token prompts and 4
    # tokens), and the decode batch of `rows` rows is what this test is about
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)
    runs, rows = {}, None
    for flag in ("0", "1"):
        monkeypatch.setenv("DUPLEX_BF16_STREAM", flag)
        core = make_core(default_model, weights_dtype="auto", kv_cache_dtype=kv_dtype,
                         num_kv_blocks=128)
        # a decode batch above every weight's few-row kernel (VNNI's, or AVX2's GGUF rows)
        rows = rows or max(quant.MAX_VNNI_ROWS + 4, stream_rows(core.model) + 1)
        prompts = [list(range(100 + 7 * i, 104 + 7 * i + i % 3)) for i in range(rows)]
        runs[flag] = run_engine(core, prompts, params)
        assert (len(calls) > 0) == (flag == "1")
    assert rows in calls  # a decode batch took it, not only prefill
    assert runs["1"] == runs["0"]


def test_mixed_type_projections_equal_the_per_op_path(tmp_path, monkeypatch):
    """A Q4_K_M-like file (tests/engine/test_quantized.py): q/k Q4_0 beside a Q6_K v, a Q5_0
    gate beside a Q8_0 up. The C step runs each part with its own kernel into its columns,
    as quant.FusedWeight does per op: tokens and logprobs bitwise equal."""
    from tests.engine.test_quantized import VOCAB, write_mixed_llama

    path = str(tmp_path / "mixed.gguf")
    write_mixed_llama(path)
    calls = []
    forward = DecodeStack.forward
    monkeypatch.setattr(DecodeStack, "forward",
                        lambda self, h, *a: calls.append(h.shape[0]) or forward(self, h, *a))
    prompts = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (5, 23, 11)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DUPLEX_FUSED_DECODE", flag)
        core = make_core(path, weights_dtype="auto", kv_cache_dtype="auto", num_kv_blocks=32)
        runs[flag] = run_engine(core, prompts, params, arrivals=[0, 2, 3])
    stack = core.model._decode_stack
    assert isinstance(stack, DecodeStack) and calls and set(calls) <= {1, 2, 3}
    layer = stack._keep[0][0]
    assert [len(layer.qkv), len(layer.o), len(layer.gate_up), len(layer.down)] == [3, 1, 2, 1]
    assert runs["1"] == runs["0"]


def test_mixed_type_projections_take_the_bf16_stream(tmp_path, monkeypatch):
    """The fused projections of a Q4_K_M-like file (parts of different types) stream bf16
    like single weights (quant.FusedWeight.dense_from_rows: the most of its parts'), and the
    stream's tokens and logprobs are bitwise those of the fp32 activations path. (Before,
    one fused projection turned the stream off for the whole model: pp512 312 against 382
    tok/s at the 1B shape in Q4_K_M on an AMX CPU.) The Q6_K part's prompts take the bf16
    GEMM too: their int8 activations (the default on AVX-512 VNNI without AMX) are off."""
    from duplex.kernels import cpu_fused, quant
    from tests.engine.test_quantized import VOCAB, write_mixed_llama

    path = str(tmp_path / "mixed.gguf")
    write_mixed_llama(path)
    monkeypatch.setenv("DUPLEX_PROMPT_GEMM", "bf16")
    monkeypatch.setenv("DUPLEX_INT8_PROMPT", "0")
    monkeypatch.setattr(core_module, "load", functools.lru_cache(maxsize=1)(loader.load))
    calls = []
    fused = cpu_fused.rope_store_kv
    monkeypatch.setattr(cpu_fused, "rope_store_kv",
                        lambda qkv, *a: calls.append(qkv.shape[0]) or fused(qkv, *a))
    prompts = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (5, 23, 11)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DUPLEX_BF16_STREAM", flag)
        core = make_core(path, weights_dtype="auto", kv_cache_dtype="auto", num_kv_blocks=32)
        assert isinstance(core.model.layers[0].attn.qkv_weight, quant.FusedWeight)
        assert stream_rows(core.model) is not None
        runs[flag] = run_engine(core, prompts, params)
        assert (len(calls) > 0) == (flag == "1")  # the prompt steps streamed
    assert runs["1"] == runs["0"]

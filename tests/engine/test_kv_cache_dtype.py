"""--kv-cache-dtype: what auto picks, what the pool is sized and keyed by, and that blocks
of one KV precision are never served to an engine of another (engine/core.py)."""
from __future__ import annotations

import pytest
import torch

from duplex.engine.config import EngineConfig
from duplex.engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core, run_engine


@pytest.mark.parametrize("weights, kv, expected", [
    ("auto", "auto", torch.bfloat16),      # quantized weights: the fast mode
    ("auto", "float32", torch.float32),
    ("float32", "auto", torch.float32),    # the exact mode stays exact
    ("float32", "bfloat16", torch.bfloat16),
    ("bfloat16", "auto", torch.bfloat16),  # the activations' dtype
])
def test_auto_and_explicit_choices(default_model, weights, kv, expected):
    core = make_core(default_model, weights_dtype=weights, kv_cache_dtype=kv, num_kv_blocks=8)
    assert core.kv_dtype == expected
    assert all(k.dtype == v.dtype == expected for k, v in core.runner.kv_caches)


def test_batch_invariance_keeps_fp32_kv(default_model):
    core = make_core(default_model, batch_invariant=True, num_kv_blocks=8)
    assert core.kv_dtype == torch.float32


def test_the_pool_holds_twice_the_blocks_in_bf16(default_model):
    sizes = {kv: make_core(default_model, kv_cache_dtype=kv, weights_dtype="auto",
                           kv_cache_bytes=64 << 20).num_kv_blocks for kv in ("float32", "bfloat16")}
    assert sizes["bfloat16"] == 2 * sizes["float32"]


def test_an_unknown_kv_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype.*auto, float32, bfloat16"):
        EngineConfig.of(kv_cache_dtype="fp8")


def test_blocks_of_another_kv_precision_are_misses(default_model, tmp_path):
    """Same model and weights, another KV dtype: another key namespace, so the disk tier
    written by one engine serves the other nothing (and the hand-off's Ready carries it)."""
    prompt = [list(range(100, 180))]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = make_core(default_model, kv_cache_dtype="bfloat16", kv_dir=str(tmp_path),
                      num_kv_blocks=32)
    run_engine(first, prompt, params)
    first.close()
    again = make_core(default_model, kv_cache_dtype="bfloat16", kv_dir=str(tmp_path),
                      num_kv_blocks=32)
    other = make_core(default_model, kv_cache_dtype="float32", kv_dir=str(tmp_path),
                      num_kv_blocks=32)
    assert again.kv_format != other.kv_format
    assert again._namespace(None) != other._namespace(None)
    for core, hits in ((again, True), (other, False)):
        run_engine(core, prompt, params)
        assert (core.stats().num_cached_prompt_tokens > 0) is hits
        core.close()

"""duplex.bench.attention on tiny shapes: the paged keys it builds are a permutation of the pool's
slots, each sequence's in position order inside its blocks, and a run reports every figure
(the kernel's own correctness is tests/kernels/test_cpu_attention.py)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from duplex.bench import attention
from duplex.kernels import cpu_attention


def args_for(tmp_path, *extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    return parser.parse_args(["--batch", "3", "--context", "21", "--layers", "2",
                              "--repeats", "1", "--stream-mb", "4", "--out",
                              str(tmp_path / "a.json"), *extra])


def test_the_paged_batch_covers_the_pool_in_shuffled_blocks(tmp_path):
    args = args_for(tmp_path)
    q, caches, keys = attention.paged_batch(args)
    assert q.shape == (3, 9, 64) and len(caches) == 2 and keys.shape == (3, 21)
    blocks = caches[0][0].shape[0]
    assert blocks == 3 * 2  # 21 keys in blocks of 16: two blocks a sequence
    assert (keys % 16 == torch.arange(21) % 16).all()  # positions in order within a block
    firsts = (keys[:, [0, 16]] // 16).flatten()
    assert sorted(firsts.tolist()) == list(range(blocks))  # every block used once


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler or no AVX512")
def test_a_run_reports_every_figure(tmp_path, capsys):
    assert attention.run(args_for(tmp_path)) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    for key in ("cached_ms", "rotating_ms", "rotating_gbs", "stream_read_gbs"):
        assert result[key] > 0, key
    assert result["kv_mb_per_layer"] == pytest.approx(2 * 3 * 21 * 3 * 64 * 4 / 1e6)
    assert "distinct caches in turn" in capsys.readouterr().out


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler or no AVX512")
def test_isa_avx2_times_the_avx2_build(tmp_path, monkeypatch):
    """--isa avx2 swaps in the library built without AVX-512 (where this CPU has AVX2)."""
    monkeypatch.setattr(cpu_attention, "_lib", cpu_attention._lib)  # restored after
    if attention.run(args_for(tmp_path, "--isa", "avx2")) != 0:
        assert not cpu_attention.use_avx2_build()
        pytest.skip("no AVX2 build here")
    assert json.loads((tmp_path / "a.json").read_text())["args"]["isa"] == "avx2"
    assert cpu_attention._load().attn_lanes() == 8  # the AVX2 build is what ran


@pytest.mark.skipif(not cpu_attention.prefill_available(), reason="no prompt kernel here")
@pytest.mark.parametrize("queries", [21, 6])
def test_a_prompt_run_reports_both_kernels(tmp_path, capsys, queries):
    """A whole prompt (causal) and a step after a cached prefix (masked)."""
    assert attention.run(args_for(tmp_path, "--queries", str(queries))) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    for key in ("kernel_ms", "torch_ms", "kernel_gmacs", "torch_gmacs"):
        assert result[key] > 0, key
    assert "torch's fused attention" in capsys.readouterr().out

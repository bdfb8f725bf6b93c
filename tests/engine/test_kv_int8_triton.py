"""An int8 KV pool on the engine's device kernel path, run on the CPU (kernels._triton.on_cpu:
the triton store and paged / split-KV attention under the interpreter): the packed rows are
quantized and read as on the torch path, so the greedy tokens, prefix hits included, are
the torch path's."""
from __future__ import annotations

import pytest
import torch

from duplex.engine.sampling_params import SamplingParams
from duplex.kernels import _triton, decode_attention, kv_store
from tests.disagg.conftest import VOCAB, tiny_model
from tests.engine.conftest import make_core, run_engine

pytestmark = pytest.mark.skipif(not (_triton.HAS_TRITON and _triton.is_interpreter()),
                                reason="needs triton's interpreter (TRITON_INTERPRET=1, no CUDA)")

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(17)], [5, 9, 13]]


def _run(core):
    first = run_engine(core, PROMPTS, GREEDY)
    turn2 = PROMPTS[0] + first["r0"][0] + [3, 4]  # the next turn: a prefix hit
    again = run_engine(core, [turn2], GREEDY)
    return ({k: ids for k, (ids, _) in first.items()}, again["r0"][0],
            core.stats().num_cached_prompt_tokens, core.runner.kv.clone())


def test_the_device_kernel_path_on_an_int8_pool_gives_the_torch_paths_tokens(monkeypatch):
    launched = set()
    for module, name in ((kv_store, "store_kv_triton"),
                         (decode_attention, "decode_attention_triton")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **k:
                            (launched.add(_n), _r(*a, **k))[1])
    config = dict(kv_cache_dtype="int8", block_size=8, max_num_batched_tokens=16,
                  num_kv_blocks=32, num_threads=1, max_model_len=256)
    reference = _run(make_core(tiny_model(), **config))
    with _triton.on_cpu():
        got = _run(make_core(tiny_model(), **config))
    assert launched == {"store_kv_triton", "decode_attention_triton"}
    assert got[:3] == reference[:3] and reference[2] >= 16
    # the same int8 values in the same slots, but for a rounding flip where k or v differ
    # in their last bit (the triton rotary and norms against torch's)
    assert got[3].dtype == torch.int8
    assert int((got[3][..., :-4].int() - reference[3][..., :-4].int()).abs().max()) <= 1

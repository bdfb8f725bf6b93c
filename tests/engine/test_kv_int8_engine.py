"""--kv-cache-dtype int8 through the engine: the pool of packed rows and its size, greedy
decoding end to end (prefix-cache hits and chunked prefill change nothing), speculation,
the blocks' own namespace and encoding on the disk tier, and what is refused at load."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from duplex import LLM
from duplex.engine.kv_tiers import BlockCodec
from duplex.engine.model_runner import ModelRunner, check_kv_dtype
from duplex.engine.sampling_params import SamplingParams
from duplex.kernels.kv_store import INT8_ENCODING, quantize_rows
from duplex.kvstore.disk import DiskConfig, DiskTier
from duplex.kvstore.keys import namespace
from tests.disagg.conftest import VOCAB, tiny_model
from tests.engine.conftest import make_core, run_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(70)], list(range(40, 57)), [5, 9, 13]]


def _core(kv: str = "int8", **kwargs):
    kwargs.setdefault("num_kv_blocks", 48)
    return make_core(tiny_model(), kv_cache_dtype=kv, num_threads=1, max_model_len=256,
                     **kwargs)


def _tokens(out: dict) -> dict:
    return {req_id: ids for req_id, (ids, _) in out.items()}


def test_the_pool_is_one_tensor_of_packed_rows():
    core = _core()
    head_dim = core.args.head_dim
    assert core.kv_dtype == torch.int8 and core.kv_format.endswith("/kv=int8")
    assert core.runner.kv.dtype == torch.int8 and core.runner.kv.shape[-1] == head_dim + 4
    assert all(k.shape[-1] == head_dim + 4 for k, _ in core.runner.kv_caches)


def test_a_pool_of_the_same_bytes_holds_more_int8_blocks():
    """bf16 -> int8 is 2 * head_dim -> head_dim + 4 bytes a row: 1.88x at SmolLM2's 64."""
    smol = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    per_block = {dtype: ModelRunner.bytes_per_block(smol, 16, dtype)
                 for dtype in (torch.bfloat16, torch.int8)}
    assert per_block[torch.int8] == 30 * 2 * 16 * 3 * 68
    assert per_block[torch.bfloat16] / per_block[torch.int8] == pytest.approx(1.88, abs=0.01)
    for kv, dtype in (("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        core = _core(kv, num_kv_blocks=None, kv_cache_bytes=1 << 20)
        assert core.num_kv_blocks == (1 << 20) // ModelRunner.bytes_per_block(core.args, 16, dtype)
        assert core.runner.kv.nbytes == core.num_kv_blocks * ModelRunner.bytes_per_block(
            core.args, 16, dtype)


def test_greedy_is_unchanged_by_a_prefix_hit_or_chunked_prefill():
    cold = _tokens(run_engine(_core(), PROMPTS, GREEDY))
    core = _core()
    run_engine(core, PROMPTS[:1], GREEDY)
    warm = _tokens(run_engine(core, PROMPTS, GREEDY))
    assert core.stats().num_cached_prompt_tokens >= 64  # r0's four full blocks, again
    chunked = _tokens(run_engine(_core(max_num_batched_tokens=16), PROMPTS, GREEDY))
    assert cold == warm == chunked
    assert all(len(ids) == GREEDY.max_tokens for ids in cold.values())


def test_int8_kv_logprobs_stay_near_float32_kv():
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    int8, exact = (run_engine(_core(kv), PROMPTS, params) for kv in ("int8", "float32"))
    for req_id, (ids, logprobs) in exact.items():
        assert int8[req_id][0][:2] == ids[:2], req_id
        assert int8[req_id][1][0] == pytest.approx(logprobs[0], abs=0.05)


def test_llm_generates_with_an_int8_kv_cache_and_speculation_keeps_its_tokens():
    llm = LLM(tiny_model(), kv_cache_dtype="int8", weights_dtype="float32", num_kv_blocks=48,
              num_threads=1, max_model_len=256, tokenizer=False, progress=False)
    plain = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert llm.engine.runner.kv.dtype == torch.int8
    spec = LLM(tiny_model(), kv_cache_dtype="int8", weights_dtype="float32",
               num_kv_blocks=48, num_threads=1, max_model_len=256, tokenizer=False,
               progress=False, speculation="self", num_draft_tokens=3)
    assert [out.token_ids for out in spec.generate(PROMPTS, GREEDY)] == plain


def test_batch_invariant_mode_takes_an_int8_pool():
    core = _core(batch_invariant=True)
    alone = _tokens(run_engine(core, PROMPTS[2:], GREEDY))
    mixed = _tokens(run_engine(_core(batch_invariant=True), PROMPTS, GREEDY))
    assert mixed["r2"] == alone["r0"]


def test_disk_blocks_round_trip_bit_identical_and_only_into_an_int8_pool(tmp_path):
    gen = torch.Generator().manual_seed(0)
    pool = quantize_rows(torch.randn(3, 2, 6, 16, 2, 16, generator=gen))  # [L, 2, N, 16, H, 20]
    codec = BlockCodec(pool)
    entries = [codec.save(b, expires_at=2e9) for b in (1, 4)]
    assert all(e.encoding == INT8_ENCODING and e.dtype == "int8" for e in entries)
    ns = namespace("tiny", "float32/none/float32/kv=int8", 16)

    async def through_disk():
        config = DiskConfig(str(tmp_path), ns, 1 << 20)
        first = DiskTier(config)
        await first.start()
        for i, entry in enumerate(entries):
            assert first.put(bytes([i]) * 16, entry)
        await first.close()
        again = DiskTier(config)  # a restart: the files are all there is
        await again.start()
        read = [await again.get(bytes([i]) * 16) for i in range(len(entries))]
        await again.close()
        return read

    read = asyncio.run(through_disk())
    fresh = torch.zeros_like(pool)
    target = BlockCodec(fresh)
    for block_id, entry in zip((2, 5), read):
        assert target.fits(entry)
        target.load(block_id, entry)
    assert torch.equal(fresh[:, :, 2], pool[:, :, 1]) and torch.equal(fresh[:, :, 5], pool[:, :, 4])
    bf16 = BlockCodec(torch.zeros(3, 2, 6, 16, 2, 10, dtype=torch.bfloat16))  # same bytes
    assert bf16.nbytes == codec.nbytes and not any(bf16.fits(e) for e in read)
    assert not target.fits(dataclasses.replace(read[0], encoding=""))  # plain int8 elements


def test_an_int8_engine_hits_its_own_disk_blocks_and_a_bf16_one_none(tmp_path):
    prompt = [PROMPTS[0]]
    first = _core(kv_dir=str(tmp_path))
    expected = _tokens(run_engine(first, prompt, GREEDY))
    first.close()
    for kv, hits in (("int8", True), ("bfloat16", False)):
        core = _core(kv, kv_dir=str(tmp_path))
        out = _tokens(run_engine(core, prompt, GREEDY))
        assert (core.stats().num_cached_prompt_tokens > 0) is hits, kv
        if hits:
            assert out == expected
        core.close()


def test_what_an_int8_pool_refuses_at_load():
    mla = SimpleNamespace(mla=object(), arch="deepseek_v3", head_dim=288)
    with pytest.raises(ValueError, match="MLA latent cache of deepseek_v3"):
        check_kv_dtype(mla, torch.int8)
    check_kv_dtype(mla, torch.bfloat16)  # float caches: as before
    with pytest.raises(ValueError, match="head_dim % 4 == 0.*is 30"):
        check_kv_dtype(SimpleNamespace(mla=None, arch="llama", head_dim=30), torch.int8)


def test_sliding_window_layers_keep_int8_rows_and_a_bonded_hit_changes_nothing(tmp_path):
    from tests.models_swa.test_swa_greedy import build_tiny
    path = build_tiny("gemma3", str(tmp_path))
    kwargs = dict(kv_cache_dtype="int8", block_size=8, num_kv_blocks=64, num_threads=1)
    core = make_core(path, **kwargs)
    assert core.layout is not None and core.runner.swa_kv.dtype == torch.int8
    assert core.runner.swa_kv.shape[-1] == core.runner.kv.shape[-1] == core.args.head_dim + 4
    first = [(5 * i + 2) % VOCAB for i in range(40)]
    out = _tokens(run_engine(core, [first], GREEDY))["r0"]
    turn2 = first + out + [7, 8, 9, 10, 11]  # hits the bond left where the first one ended
    warm = _tokens(run_engine(core, [turn2], GREEDY))["r0"]
    assert core.kv.accounting["r0"].num_restored > 0
    cold = make_core(path, enable_prefix_caching=False, **kwargs)
    assert warm == _tokens(run_engine(cold, [turn2], GREEDY))["r0"]

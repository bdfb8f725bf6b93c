"""Hybrid KV (engine/hybrid_kv.py) on tiny random sliding-window models: a bonded-window hit,
a replay and a cold run give the same greedy tokens; an SWA request holds only its window's
blocks however long it decodes; a model without SWA layers keeps the single-group manager."""
from __future__ import annotations

import pytest
import torch

from duplex.engine.hybrid_kv import HybridKVCacheManager
from duplex.engine.kv_manager import KVCacheManager, cdiv
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core, run_engine
from tests.models_swa.test_swa_greedy import VOCAB, WINDOW, build_tiny

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield str(tmp_path_factory.mktemp("hybrid"))
    torch.set_num_threads(threads)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_one(core, prompt: list[int], req_id: str = "r0") -> list[int]:
    return run_engine(core, [prompt], GREEDY)["r0"][0]


def cold(path: str, prompt: list[int]) -> list[int]:
    return run_one(make_core(path, block_size=BLOCK, num_kv_blocks=64,
                             enable_prefix_caching=False), prompt)


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_bonded_hit_replay_and_cold_agree(model_root, name):
    path = build_tiny(name, model_root)
    core = make_core(path, block_size=BLOCK, num_kv_blocks=64)
    assert isinstance(core.kv, HybridKVCacheManager)
    first = tokens(40, 1)
    out = run_one(core, first)
    # a continuation (the next turn) hits the bond left where the first request ended
    turn2 = first + out + tokens(9, 2)
    assert run_one(core, turn2) == cold(path, turn2)
    acc = core.kv.accounting["r0"]
    end = (len(first) + len(out) - 1) // BLOCK * BLOCK
    assert (acc.num_restored, acc.num_replayed, acc.num_prefilled) == (end, 0, len(turn2) - end)
    # a branch off the middle of turn 2 finds full blocks but no bond there: replay
    branch = turn2[:36] + tokens(7, 3)
    assert run_one(core, branch) == cold(path, branch)
    acc = core.kv.accounting["r0"]
    assert acc.num_replayed > 0 and acc.num_restored + acc.num_replayed == 32
    # the replay left a bond at the branch point: the next branch there restores it
    branch2 = turn2[:36] + tokens(5, 4)
    assert run_one(core, branch2) == cold(path, branch2)
    assert core.kv.accounting["r0"][:2] == (32, 0)
    hybrid = core.stats().kv.hybrid
    assert hybrid.tokens_replayed == acc.num_replayed
    assert 0 < hybrid.bytes_per_cached_token


def test_hybrid_matches_all_layer_kv(model_root):
    path = build_tiny("gemma3", model_root)
    prompt = tokens(29, 5)
    plain = make_core(path, block_size=BLOCK, num_kv_blocks=64, hybrid_kv=False)
    assert plain.layout is None and type(plain.kv) is KVCacheManager
    assert run_one(plain, prompt) == cold(path, prompt)


def test_swa_blocks_stay_within_window_during_long_decode(model_root):
    path = build_tiny("gemma3", model_root)
    core = make_core(path, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    core.add_request(AddRequest("long", tokens(30, 6), params))
    core.add_request(AddRequest("other", tokens(20, 7), params))
    limit = cdiv(WINDOW, BLOCK) + cdiv(16, BLOCK) + 1  # window + this step's chunk
    max_held = 0
    while core.has_unfinished_requests():
        core.step()
        for req in core.scheduler.running:
            held = core.kv.num_swa_blocks_held(req)
            assert held <= limit, f"{req.req_id} holds {held} SWA blocks"
            max_held = max(max_held, held)
            if req.num_computed_tokens > 40:  # decoding: window plus the current block
                assert held <= cdiv(WINDOW, BLOCK) + 1
    assert max_held > 0
    bonds = {b for bond in core.kv.bonds.values() for b in bond.block_ids}
    assert core.kv.swa_pool.num_used_blocks == len(bonds)


def test_model_without_swa_layers_keeps_one_group(tmp_path):
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                            max_position_embeddings=128)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    core = make_core(str(tmp_path), block_size=BLOCK, num_kv_blocks=32)
    assert core.layout is None and type(core.kv) is KVCacheManager
    assert core.runner.kv.shape[0] == 2 and core.runner.swa_kv is None
    assert core.stats().kv.hybrid is None

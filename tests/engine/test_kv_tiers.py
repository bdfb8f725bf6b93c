"""KV cache hierarchy end to end on the default model: device, host-RAM and disk hits give
the cold output token for token; a restart keeps the cache; corrupt files, other tenants
and expired blocks are misses. Small pools (block_size 8, 8 blocks) so eviction happens."""
from __future__ import annotations

import concurrent.futures
import random
import time
from pathlib import Path

import pytest

from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from duplex.kvstore import keys as kvkeys
from duplex.kvstore.errors import KVStoreError
from tests.engine.conftest import make_core

BS = 8
PARAMS = SamplingParams(temperature=0, ignore_eos=True, max_tokens=3)
LONG_PARAMS = SamplingParams(temperature=0, ignore_eos=True, max_tokens=9)
_rng = random.Random(5)
PROMPT_A = [_rng.randrange(1000, 20000) for _ in range(40)]  # 4 hittable blocks + 8 tokens
PROMPT_B = [_rng.randrange(1000, 20000) for _ in range(40)]
DAY_S = 86_400.0


def tiered_core(model, **kwargs):
    kwargs = dict(block_size=BS, num_kv_blocks=8, kv_host_bytes=64 << 20) | kwargs
    return make_core(model, **kwargs)


def generate(core, prompt, req_id, salt="", retention="chat", params=PARAMS):
    """Greedy tokens of one request and the cache hit it reports, per tier."""
    core.add_request(AddRequest(req_id, prompt, params, cache_salt=salt, retention=retention))
    return drain(core)[req_id]


def drain(core) -> dict[str, tuple[list[int], dict[str, int]]]:
    """Step until idle: per request, its tokens and the cache hit it reported."""
    out: dict[str, tuple[list[int], dict[str, int]]] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens = out.get(delta.req_id, ([], {}))[0] + delta.new_token_ids
            out[delta.req_id] = (tokens, delta.cached_tokens_by_tier)
    return out


def cold(core, prompt, req_id="ref"):
    """The cold output: another tenant's namespace never hits this test's blocks."""
    tokens, by_tier = generate(core, prompt, req_id, salt=kvkeys.tenant_salt("cold").hex())
    assert sum(by_tier.values()) == 0
    return tokens


def hit(device=0, host=0, disk=0, shared=0):
    return {"device": device, "host": host, "disk": disk, "shared": shared}


def test_device_and_host_hits_equal_cold(default_model):
    core = tiered_core(default_model)
    ref, by_tier = generate(core, PROMPT_A, "a1")
    assert by_tier == hit()
    assert generate(core, PROMPT_A, "a2") == (ref, hit(device=32))
    generate(core, PROMPT_B, "b")  # its 6 blocks evict A's deepest 4 into host RAM
    assert generate(core, PROMPT_A, "a3") == (ref, hit(device=16, host=16))
    core.pool.evict_all_cached()
    assert generate(core, PROMPT_A, "a4") == (ref, hit(host=32))
    kv = core.stats().kv
    assert (kv.device.hit_tokens, kv.host.hit_tokens) == (48, 48)
    assert kv.queried_tokens == 5 * 40 and kv.hit_rate == 96 / 200
    assert kv.device.evictions >= 4 and kv.host.bytes > 0
    core.close()


def test_restart_continues_conversation_from_disk(default_model, tmp_path):
    core = tiered_core(default_model, kv_dir=str(tmp_path), num_kv_blocks=16)
    reply, _ = generate(core, PROMPT_A, "turn1", params=LONG_PARAMS)
    turn2 = PROMPT_A + reply + PROMPT_B[:12]  # 61 tokens; turn 1 computed 6 full blocks
    ref = cold(core, turn2)
    core.close()

    core = tiered_core(default_model, kv_dir=str(tmp_path), num_kv_blocks=16)
    gate = _gate_prefetch(core)
    core.add_request(AddRequest("turn2", turn2, PARAMS))
    core.add_request(AddRequest("other", PROMPT_B, PARAMS))
    core.step()
    assert [r.req_id for r in core.scheduler.running] == ["other"], \
        "a request waiting for disk reads must not hold up other work"
    gate.set_result(None)
    assert drain(core)["turn2"] == (ref, hit(disk=48))
    kv = core.stats().kv
    assert kv.disk.hit_tokens == 48 and kv.disk.entries > 0
    core.close()


def test_corrupt_disk_file_is_a_counted_miss(default_model, tmp_path):
    core = tiered_core(default_model, kv_dir=str(tmp_path), kv_host_bytes=0)
    ref, _ = generate(core, PROMPT_A, "a1")
    key = kvkeys.block_keys(core._namespace(""), PROMPT_A, BS)[1]
    core.close()
    path, = tmp_path.rglob(kvkeys.key_hex(key))
    _flip_byte(path, offset=-100)

    core = tiered_core(default_model, kv_dir=str(tmp_path), kv_host_bytes=0)
    assert generate(core, PROMPT_A, "a2") == (ref, hit(disk=8)), "stops at the damaged block"
    assert core.stats().kv.corrupt_dropped == 1
    core.close()


def test_tenants_never_hit_each_other(default_model):
    core = tiered_core(default_model, num_kv_blocks=16)
    salt_a, salt_b = kvkeys.tenant_salt("key-a").hex(), kvkeys.tenant_salt("key-b").hex()
    ref, _ = generate(core, PROMPT_A, "a1", salt=salt_a)
    core.pool.evict_all_cached()  # tenant A's blocks now live in host RAM only
    assert generate(core, PROMPT_A, "b1", salt=salt_b) == (ref, hit())
    assert generate(core, PROMPT_A, "a2", salt=salt_a) == (ref, hit(host=32))
    assert generate(core, PROMPT_A, "b2", salt=salt_b) == (ref, hit(device=32))
    core.close()


def test_agent_blocks_expire_after_three_days_chat_blocks_do_not(default_model, tmp_path):
    t0 = time.time()
    core = tiered_core(default_model, kv_dir=str(tmp_path))
    core.tiers.clock = lambda: t0
    generate(core, PROMPT_A, "agent", retention="agent")
    ref_b, _ = generate(core, PROMPT_B, "chat", retention="chat")
    core.close()

    core = tiered_core(default_model, kv_dir=str(tmp_path))
    core.tiers.clock = lambda: t0 + 3 * DAY_S + 60
    assert generate(core, PROMPT_A, "agent2")[1] == hit()
    assert generate(core, PROMPT_B, "chat2") == (ref_b, hit(disk=32))
    assert core.stats().kv.expirations >= 1
    core.close()


def test_unusable_kv_dir_fails_at_start(default_model, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(KVStoreError, match="kv-dir .*file"):
        tiered_core(default_model, kv_dir=str(not_a_dir))


def _gate_prefetch(core) -> concurrent.futures.Future:
    """Hold back every prefetch's completion until the returned gate is set."""
    gate: concurrent.futures.Future = concurrent.futures.Future()
    real_prefetch = core.tiers.prefetch

    def gated(keys, landed=None, shared_keys=()):
        out: concurrent.futures.Future = concurrent.futures.Future()
        real = real_prefetch(keys, landed, shared_keys)
        gate.add_done_callback(lambda _: out.set_result(real.result()))
        return out

    core.tiers.prefetch = gated
    core.kv.tiers.load_timeout_s = 60.0
    return gate


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))

"""The fleet-shared KV tier with real engines: two workers (EngineCores) share one
redis-server or one shared directory. A worker that joins late hits what another computed,
a conversation continued on another worker hits, output is token for token the cold one,
tenants stay apart, and a store that is down, dies or is slow never fails or stalls a
request."""
from __future__ import annotations

import functools
import random
import time

import pytest

from duplex.engine import kv_tiers
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from duplex.kvstore import keys as kvkeys
from duplex.kvstore.shared import SharedConfig, SharedTier, open_shared
from tests.disagg.conftest import tiny_model
from tests.engine.conftest import make_core
from tests.engine.test_kv_tiers import BS, PARAMS, drain

FAST = SharedConfig(op_timeout_s=0.5, max_failures=1, cooldown_s=0.2)
_rng = random.Random(11)
PROMPT_A, PROMPT_B, FOLLOW_UP = ([_rng.randrange(5, 380) for _ in range(n)] for n in (40, 40, 20))


@pytest.fixture(scope="module")
def default_model() -> str:
    """A tiny random Llama (built once): these tests are about the tier, not the model."""
    return tiny_model()


@pytest.fixture(autouse=True)
def _fast_breaker(monkeypatch):
    """Short cooldowns, so off -> on takes a fraction of a second here (5 s by default)."""
    monkeypatch.setattr(kv_tiers, "open_shared", functools.partial(open_shared, config=FAST))


@pytest.fixture(params=["redis", "dir"])
def shared_url(request, tmp_path):
    if request.param == "dir":
        return str(tmp_path / "shared")
    server = request.getfixturevalue("redis_factory")()
    return server.url


def worker(model, url, **kwargs):
    return make_core(model, **{"block_size": BS, "num_kv_blocks": 16, "kv_remote": url,
                               **kwargs})


def generate(core, prompt, req_id, salt="", params=PARAMS):
    core.add_request(AddRequest(req_id, prompt, params, cache_salt=salt))
    return drain(core)[req_id]


def shared_hit(by_tier) -> int:
    return by_tier.get("shared", 0)


@pytest.fixture(scope="module")
def cold_outputs(default_model):
    core = make_core(default_model, block_size=BS, num_kv_blocks=16)
    outs = {name: generate(core, prompt, name)[0]
            for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B))}
    core.close()
    return outs


def test_late_worker_hits_what_another_computed(default_model, shared_url, cold_outputs):
    first = worker(default_model, shared_url)
    tokens, by_tier = generate(first, PROMPT_A, "r1")
    assert tokens == cold_outputs["a"] and sum(by_tier.values()) == 0
    first.tiers.flush()
    late = worker(default_model, shared_url)  # joins after the block was published
    tokens, by_tier = generate(late, PROMPT_A, "r2")
    assert tokens == cold_outputs["a"], "a shared hit gives the cold output"
    assert shared_hit(by_tier) == 32  # 4 full blocks of 8
    kv = late.stats().kv
    assert kv.shared.hit_tokens == 32 and kv.shared_tier.on == 1
    assert kv.shared_tier.hits == 4 and kv.shared_tier.bytes_read > 0
    first.close(), late.close()


def test_conversation_continued_on_another_worker(default_model, shared_url):
    a, b = worker(default_model, shared_url), worker(default_model, shared_url)
    long_params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=9)
    turn1, _ = generate(a, PROMPT_A, "t1", params=long_params)
    a.tiers.flush()
    turn2 = PROMPT_A + turn1 + FOLLOW_UP
    ref = make_core(default_model, block_size=BS, num_kv_blocks=16)
    expected, _ = generate(ref, turn2, "ref")
    tokens, by_tier = generate(b, turn2, "t2")
    assert tokens == expected
    assert shared_hit(by_tier) == (len(PROMPT_A) + len(turn1) - 1) // BS * BS  # 48
    a.close(), b.close(), ref.close()


def test_tenants_never_hit_each_others_shared_entries(default_model, shared_url):
    a, b = worker(default_model, shared_url), worker(default_model, shared_url)
    salt_a, salt_b = kvkeys.tenant_salt("key-a").hex(), kvkeys.tenant_salt("key-b").hex()
    generate(a, PROMPT_B, "a1", salt=salt_a)
    a.tiers.flush()
    assert shared_hit(generate(b, PROMPT_B, "b1", salt=salt_b)[1]) == 0
    assert shared_hit(generate(b, PROMPT_B, "a2", salt=salt_a)[1]) == 32
    a.close(), b.close()


def test_store_down_at_start_runs_cold_then_comes_on(default_model, redis_factory,
                                                     cold_outputs):
    server = redis_factory(started=False)
    core = worker(default_model, server.url)
    assert core.stats().kv.shared_tier.on == 0, "the tier reports itself off"
    assert generate(core, PROMPT_A, "r1") == (cold_outputs["a"],
                                              {"device": 0, "host": 0, "disk": 0, "shared": 0})
    server.start()
    _until(lambda: core.stats().kv.shared_tier.on == 1)
    generate(core, PROMPT_B, "r2")
    core.tiers.flush()
    other = worker(default_model, server.url)
    assert shared_hit(generate(other, PROMPT_B, "r3")[1]) == 32
    core.close(), other.close()


def test_store_killed_mid_run_and_restarted(default_model, redis_factory, cold_outputs):
    server = redis_factory()
    a, b = worker(default_model, server.url), worker(default_model, server.url)
    generate(a, PROMPT_A, "r1")
    a.tiers.flush()
    server.kill()
    tokens, by_tier = generate(b, PROMPT_A, "r2")  # no request fails: it runs cold
    assert tokens == cold_outputs["a"] and shared_hit(by_tier) == 0
    server.start()  # empty again: the store lost everything
    _until(lambda: b.stats().kv.shared_tier.on == 1)
    generate(b, PROMPT_B, "r3")
    b.tiers.flush()
    assert shared_hit(generate(a, PROMPT_B, "r4")[1]) == 32, "hits resume"
    a.close(), b.close()


class _SlowBackend:
    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s, self.kind = inner, delay_s, inner.kind

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def read(self, keys):
        import asyncio
        await asyncio.sleep(self.delay_s)
        return await self.inner.read(keys)


def test_slow_store_does_not_stall_the_steps_of_other_requests(default_model, redis_server,
                                                               monkeypatch):
    """Budget: with every shared read 1 s late, no step of a running request takes longer
    than 0.3 s (a step of this model here is ~10-50 ms); only the request whose prefix is
    being read waits, and for at most op_timeout_s."""
    def slow_shared(url, namespace, capacity_bytes, config=FAST, clock=time.time):
        tier = open_shared(url, namespace, capacity_bytes, config, clock=clock)
        return SharedTier(_SlowBackend(tier.backend, 1.0), config, clock=clock)
    monkeypatch.setattr(kv_tiers, "open_shared", slow_shared)
    core = worker(default_model, redis_server.url, num_kv_blocks=32)
    long_params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
    core.add_request(AddRequest("running", PROMPT_B, long_params))
    core.step()
    core.add_request(AddRequest("arrives", PROMPT_A, PARAMS))  # its shared read is slow
    step_s = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        step_s.append(time.perf_counter() - start)
    assert max(step_s) < 0.3, sorted(step_s)[-3:]
    assert core.stats().kv.shared_tier.read_errors == 1  # the read was cut at the timeout
    core.close()


def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_kv_dir_with_worker_placeholder_is_private_per_worker():
    from duplex.engine.config import EngineConfig
    config = EngineConfig.of(kv_dir="/ssd/kv/{worker}")
    assert kv_tiers.private_kv_dir(config, "prefill-1").cache.kv_dir == "/ssd/kv/prefill-1"
    plain = EngineConfig.of(kv_dir="/ssd/kv")
    assert kv_tiers.private_kv_dir(plain, "prefill-1") is plain

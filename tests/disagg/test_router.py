"""duplex.frontend.router: keys equal the workers', length buckets with their own queues and limits,
prefix affinity against load, least-loaded decode worker, health."""
from __future__ import annotations

import pytest

from duplex.engine.messages import AddRequest, Ready, WorkerStats
from duplex.engine.sampling_params import SamplingParams
from duplex.frontend.router import Router, parse_buckets

from .conftest import engine_config

BS = 16


def ready(worker_id: str, role: str = "prefill", pid: int = 1, **fields) -> Ready:
    fields.setdefault("kv_address", "tcp://127.0.0.1:1" if role == "decode" else "")
    return Ready(worker_id, role, "m", 4096, BS, 1000, pid=pid, model_identity="m-id",
                 kv_dtype="float32", kv_layout="layout", **fields)


def add(req_id: str, num_tokens: int, first: int = 1, salt: str = "") -> AddRequest:
    prompt = [(first + i) % 1000 for i in range(num_tokens)]
    return AddRequest(req_id, prompt, SamplingParams(max_tokens=4), cache_salt=salt)


def test_router_keys_are_the_workers_keys():
    from duplex.engine.core import EngineCore

    core = EngineCore(engine_config(), progress=False)
    router = Router()
    router.add_worker(Ready("p0", "prefill", core.model_name, core.max_model_len,
                            core.block_size, core.num_kv_blocks, model_identity=core.model_identity,
                            kv_dtype=core.kv_format,
                            kv_layout=getattr(core, "kv_layout", "")))
    salt = "ab" * 16
    msg = AddRequest("r", list(range(1, 70)), SamplingParams(max_tokens=1), cache_salt=salt)
    core.add_request(msg)
    req = core.requests["r"]
    keys = core.kv.update_keys(req, req.num_tokens)
    assert router._keys(msg) == keys == core.kv.block_keys("r") and len(keys) == 4


def test_buckets_have_their_own_queues_and_limits():
    router = Router(bounds=(32, 128), limits=(4, 2, 1))
    router.add_worker(ready("p0"))
    for msg in (add("long1", 400), add("long2", 400, first=7), add("mid", 100),
                add("short", 10)):
        router.enqueue(msg)
    released = [msg.req_id for msg, _ in router.pop_ready()]
    assert released == ["short", "mid", "long1"]  # one per bucket per round; long2 waits
    assert router.pop_ready() == []  # long2 stays queued (released below)
    more = [add(f"s{i}", 10, first=50 + i) for i in range(5)]
    for msg in more:
        router.enqueue(msg)
    assert [m.req_id for m, _ in router.pop_ready()] == ["s0", "s1", "s2"]  # limit 4 shorts
    router.prefill_done("p0", "long1")
    assert [m.req_id for m, _ in router.pop_ready()] == ["long2"]
    assert router.remove("s3") and not router.remove("s3")
    router.prefill_done("p0", "short")
    assert [m.req_id for m, _ in router.pop_ready()] == ["s4"]


def test_bucket_is_chosen_after_the_expected_cache_hit():
    router = Router(bounds=(32,), limits=(8, 1))
    router.add_worker(ready("p0"))
    router.enqueue(add("first", 200))
    [(_, route)] = router.pop_ready()
    assert route.num_cached_tokens == 0
    router.prefill_done("p0", "first")
    router.enqueue(add("blocker", 300, first=500))  # occupies the long bucket
    router.enqueue(add("follow-up", 210))  # 12 of its 13 blocks are cached: short
    released = {m.req_id: r for m, r in router.pop_ready()}
    assert set(released) == {"blocker", "follow-up"}
    assert released["follow-up"].num_cached_tokens == 12 * BS


def test_prefix_affinity_weighed_against_load():
    router = Router(bounds=(), limits=(100,))
    router.add_worker(ready("p0"))
    router.add_worker(ready("p1"))
    router.enqueue(add("a", 320))
    [(_, first)] = router.pop_ready()
    router.prefill_done(first.worker_id, "a")
    router.enqueue(add("b", 330))  # shares a's 20 blocks
    [(_, second)] = router.pop_ready()
    assert second.worker_id == first.worker_id and second.num_cached_tokens == 320
    router.enqueue(add("c", 900, first=300))  # no hit anywhere: the less loaded worker
    [(_, third)] = router.pop_ready()
    assert third.worker_id != first.worker_id
    router.enqueue(add("d", 330))  # 10 + 10 tokens there beat 900 + 330 on the other
    [(_, fourth)] = router.pop_ready()
    assert fourth.worker_id == first.worker_id


def test_decode_worker_is_the_least_loaded_live_one_and_roles_degrade():
    router = Router()
    router.add_worker(ready("p0"))
    router.add_worker(ready("d0", "decode"))
    router.add_worker(ready("d1", "decode"))
    router.update_stats("d0", WorkerStats(num_waiting=3))
    router.enqueue(add("r", 10))
    [(_, route)] = router.pop_ready()
    assert route == ("p0", "d1", 0)
    router.remove_worker("p0")  # no prefill worker: a decode worker runs it whole
    router.enqueue(add("s", 10, first=40))
    [(_, route)] = router.pop_ready()
    assert route.decode_id is None and route.worker_id in ("d0", "d1")
    assert router.pick_resume(exclude=("d0", "d1")) is None


def test_a_restarted_worker_starts_with_an_empty_cache_picture():
    router = Router()
    router.add_worker(ready("p0", pid=1))
    router.enqueue(add("a", 64))
    router.pop_ready()
    router.add_worker(ready("p0", pid=2))
    router.enqueue(add("b", 64))
    [(_, route)] = router.pop_ready()
    assert route.num_cached_tokens == 0


def test_parse_buckets():
    assert parse_buckets("512,4096") == (512, 4096)
    assert parse_buckets("none") == () and parse_buckets("") == ()
    for bad in ("4096,512", "x", "0,5", "5,5"):
        with pytest.raises(ValueError):
            parse_buckets(bad)


def test_with_a_shared_store_a_miss_everywhere_goes_to_the_least_loaded_worker():
    """p0 computed the prompt (it is in the shared store); p1 joined late, idle. With the
    store, p1 is expected to hit it; without one, p1 (idle) still wins, but cold."""
    for store, expected_worker, expected_hit in (("s1", "p1", 12 * BS), ("", "p1", 0)):
        router = Router(bounds=(), limits=(100,))
        router.add_worker(ready("p0", kv_shared=store))
        router.enqueue(add("first", 200))
        router.pop_ready()  # still outstanding on p0: it is busy
        router.add_worker(ready("p1", kv_shared=store))  # joins late, empty picture
        router.enqueue(add("again", 200))
        [(_, route)] = router.pop_ready()
        assert (route.worker_id, route.num_cached_tokens) == (expected_worker, expected_hit)


def test_local_hit_beats_the_same_hit_from_the_shared_store_at_equal_load():
    router = Router(bounds=(), limits=(100,))
    router.add_worker(ready("p0", kv_shared="s1"))
    router.add_worker(ready("p1", kv_shared="s1"))
    router.enqueue(add("first", 200))
    [(_, first)] = router.pop_ready()
    router.prefill_done(first.worker_id, "first")
    router.enqueue(add("again", 200))
    [(_, again)] = router.pop_ready()
    assert again.worker_id == first.worker_id, "device/RAM hit is cheaper than the store's"


def test_workers_on_different_stores_do_not_share_a_picture():
    router = Router(bounds=(), limits=(100,))
    router.add_worker(ready("p0", kv_shared="s1"))
    router.enqueue(add("first", 200))
    router.pop_ready()  # p0 stays busy with it
    router.add_worker(ready("p1", kv_shared="s2"))
    router.enqueue(add("again", 200))
    [(_, route)] = router.pop_ready()
    assert (route.worker_id, route.num_cached_tokens) == ("p1", 0), "s2 does not hold it"

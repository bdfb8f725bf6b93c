"""The served workers' prompt order (engine.step_policy.shortest_first): decoding requests
first, then prompts, running and waiting alike, shortest remaining first, aged by their wait;
against the arrival order the offline engine keeps."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from duplex.engine.block_pool import BlockPool
from duplex.engine.config import EngineConfig
from duplex.engine.core import AUTO_BATCHED_TOKENS, resolve_batched_tokens
from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.platform import cpu
from duplex.engine.request import Request
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.scheduler import Scheduler
from duplex.engine.step_policy import AGING_S, shortest_first
from duplex.kvstore import keys as kvkeys

BS = 4


def make(order: bool, *, num_blocks: int = 64, budget: int = 64) -> Scheduler:
    ns = kvkeys.namespace("fake", "f32", BS)
    kv = KVCacheManager(BlockPool(num_blocks), BS, lambda salt: ns)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512,
                     prefill_order=shortest_first() if order else None)


def request(rid: str, num_tokens: int, *, first: int = 0, arrival: float | None = None,
            max_tokens: int = 4) -> Request:
    prompt = [(first + 7 * i) % 97 + 1 for i in range(num_tokens)]
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), (),
                   arrival_time=arrival, max_tokens=max_tokens)


def run(sched: Scheduler) -> list[tuple[str, int]]:
    """One step: what it scheduled, and the requests' progress as a model step would make it
    (a finished prompt draws one token; a finished request leaves)."""
    out = sched.schedule()
    for req, num_new in out.scheduled:
        req.num_computed_tokens += num_new
        sched.kv.publish(req)
        if req.num_computed_tokens == req.num_tokens:
            req.add_token(5)
            if req.check_stop(512):
                sched.remove(req)
    return [(r.req_id, n) for r, n in out.scheduled]


def test_a_burst_of_prompts_runs_shortest_first():
    for order, expected in ((True, [("b", 10), ("c", 20), ("a", 30)]),
                            (False, [("a", 30), ("b", 10), ("c", 20)])):
        sched = make(order)
        now = time.time()
        for rid, n in (("a", 30), ("b", 10), ("c", 20)):
            sched.add(request(rid, n, first=ord(rid), arrival=now))
        assert run(sched) == expected


def test_a_short_prompt_goes_before_the_rest_of_a_running_long_one():
    sched = make(True, budget=16)
    sched.add(request("long", 100))
    assert run(sched) == [("long", 16)]
    sched.add(request("short", 5, first=3))
    assert run(sched) == [("short", 5), ("long", 11)]
    # the short one now decodes: its token comes first, the long prompt takes the rest
    assert run(sched) == [("short", 1), ("long", 15)]

    fifo = make(False, budget=16)
    fifo.add(request("long", 100))
    run(fifo)
    fifo.add(request("short", 5, first=3))
    assert run(fifo) == [("long", 16)]  # arrival order: the short one waits for the long one


def test_the_cached_prefix_does_not_count():
    for order, expected in ((True, ["warm2", "cold"]), (False, ["cold", "warm2"])):
        sched = make(order)
        sched.add(request("warm", 41, max_tokens=1))
        run(sched)  # done: its 40 full-block tokens stay cached
        assert not sched.has_unfinished
        now = time.time()
        sched.add(request("cold", 12, first=50, arrival=now))
        sched.add(request("warm2", 41, arrival=now))  # 40 of 41 tokens hit: 1 to compute
        assert run(sched) == [(rid, 1 if rid == "warm2" else 12) for rid in expected]


def test_a_long_wait_ages_a_long_prompt_ahead():
    sched = make(True, budget=40)
    now = time.time()
    sched.add(request("fresh", 20, arrival=now))
    sched.add(request("old", 40, first=9, arrival=now - 2 * AGING_S))  # 40 / 3 < 20
    assert run(sched) == [("old", 40)]


def test_decoding_requests_keep_their_token_under_a_burst():
    sched = make(True, budget=32)
    sched.add(request("s", 8))
    run(sched)
    for i in range(4):
        sched.add(request(f"p{i}", 30, first=i))
    steps = [dict(run(sched)) for _ in range(4)]
    assert all(step.get("s") == 1 for step in steps[:3])  # 4 tokens out: done after 3 more
    assert all(sum(step.values()) <= 32 for step in steps)


def test_a_prompt_without_blocks_is_passed_over_not_preempted_for():
    # 6 blocks of 4 tokens: the long prompt holds 4 of them mid-way; the short one takes the
    # last 2 and goes first, the long one waits (no preemption) and finishes after it
    sched = make(True, num_blocks=6, budget=16)
    sched.add(request("long", 23, max_tokens=1))
    assert run(sched) == [("long", 16)]
    sched.add(request("short", 6, first=3, max_tokens=2))
    assert run(sched) == [("short", 6)]
    assert run(sched) == [("short", 1)]  # its last token; the long prompt still has no room
    assert run(sched) == [("long", 7)]
    assert not sched.has_unfinished and sched.num_preemptions == 0
    assert sched.kv.pool.num_used_blocks == 0



def test_the_auto_token_budget_is_the_platforms():
    assert EngineConfig.of().scheduler.max_num_batched_tokens == 0  # auto
    assert resolve_batched_tokens(EngineConfig.of(), cpu()) == AUTO_BATCHED_TOKENS["cpu"] == 256
    gpu = SimpleNamespace(is_cuda=True)
    assert resolve_batched_tokens(EngineConfig.of(), gpu) == 512
    assert resolve_batched_tokens(EngineConfig.of(max_num_batched_tokens=100), gpu) == 100
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.of(max_num_batched_tokens=-1)


def test_a_waiting_prompts_hit_is_looked_up_once_not_every_step():
    sched = make(True, budget=8)
    looked: dict[str, int] = {}
    find = sched.kv.find_cached_blocks

    def counting(req):
        looked[req.req_id] = looked.get(req.req_id, 0) + 1
        return find(req)

    sched.kv.find_cached_blocks = counting
    now = time.time()
    for rid in "abc":
        sched.add(request(rid, 8, first=ord(rid), arrival=now, max_tokens=8))
    steps = [dict(run(sched)) for _ in range(4)]
    assert "c" not in steps[0] and "c" not in steps[1]  # it waited at least two steps
    assert looked["c"] == 2  # its place once, and its admission

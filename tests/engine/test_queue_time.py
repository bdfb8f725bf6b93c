"""Queue time in the worker: a request's `scheduled_time` is set when the scheduler first
admits it (the engine reports `scheduled_time - arrival_time` as RequestDelta.queue_s, which
/metrics turns into the queue / prefill / decode histograms), and a preemption does not
reset it."""
from __future__ import annotations

import time

from duplex.engine.block_pool import BlockPool
from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.request import Request
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.scheduler import Scheduler
from duplex.kvstore import keys as kvkeys

BS = 4


def make_scheduler(num_blocks=12, max_num_seqs=1) -> Scheduler:
    ns = kvkeys.namespace("fake", "f32", BS)
    kv = KVCacheManager(BlockPool(num_blocks), BS, lambda salt: ns)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=16, max_model_len=40)


def request(req_id: str, arrival: float) -> Request:
    return Request(req_id, [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4), (),
                   arrival_time=arrival, max_tokens=4)


def test_scheduled_time_is_the_first_admission():
    sched = make_scheduler()
    arrival = time.time()
    first, second = request("a", arrival), request("b", arrival)
    sched.add(first)
    sched.add(second)
    sched.schedule()
    assert first.scheduled_time is not None and second.scheduled_time is None
    assert first.scheduled_time >= arrival
    time.sleep(0.02)
    sched.remove(first)  # finished: room for the second
    sched.schedule()
    assert second.scheduled_time is not None
    assert second.scheduled_time - arrival >= first.scheduled_time - arrival + 0.02


def test_preemption_keeps_the_first_scheduled_time():
    sched = make_scheduler()
    req = request("a", time.time())
    sched.add(req)
    sched.schedule()
    scheduled = req.scheduled_time
    sched._preempt(req)  # the scheduler's own path when the pool runs dry
    time.sleep(0.01)
    sched.schedule()
    assert req in sched.running and req.scheduled_time == scheduled

"""Admission by work (frontend.admission): the bound counts sequences and prompt tokens, a
request larger than the bound is a 400 naming it, and the fair gate lets a 1-token chat run
beside a 256-sequence request instead of after it."""
from __future__ import annotations

import asyncio

import pytest
from frontend_fakes import FakeEngineClient

from duplex.frontend.admission import Admission, FairGate, Limits, Work
from duplex.frontend.errors import ApiError
from duplex.frontend.metrics import Metrics

HI = [{"role": "user", "content": "hi"}]
BIG = {"prompt": [f"prompt {i}" for i in range(32)], "n": 8, "max_tokens": 4}  # 256 sequences


async def test_a_small_chat_finishes_beside_a_256_sequence_request(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.005), max_running_sequences=4)
    big = asyncio.create_task(h.post("/v1/completions", BIG))
    for _ in range(200):
        if len(h.engine.active) == 4:
            break
        await asyncio.sleep(0.01)
    assert len(h.engine.active) == 4  # the gate: only 4 sequences in the engine at once
    response = await asyncio.wait_for(h.post("/v1/chat/completions",
                                             {"messages": HI, "max_tokens": 1}), 5)
    assert response.status == 200
    assert (await response.json())["usage"]["completion_tokens"] == 1
    num_big_done = sum(r.startswith("cmpl-") for r in h.engine.finished)
    assert num_big_done < 64, num_big_done  # it ran at the next free slot, not after all 256
    response = await asyncio.wait_for(big, 60)
    assert response.status == 200 and len((await response.json())["choices"]) == 256
    assert h.state.admission.num_sequences == 0 and h.state.admission.num_running == 0


async def test_a_request_over_the_bound_is_400_and_a_full_bound_is_retryable(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.02), max_queued_sequences=64,
                           max_queued_prompt_tokens=300)
    response = await h.post("/v1/completions", BIG)
    assert response.status == 400 and "Retry-After" not in response.headers
    error = (await response.json())["error"]
    assert error["code"] == "request_too_large" and "at most 64" in error["message"]
    response = await h.post("/v1/messages", {"max_tokens": 3, "messages": [
        {"role": "user", "content": "x" * 400}]})
    assert response.status == 400
    assert "at most 300 prompt tokens" in (await response.json())["error"]["message"]
    held = asyncio.create_task(h.post("/v1/completions", {"prompt": ["a"] * 8, "n": 8,
                                                          "max_tokens": 5}))
    for _ in range(200):
        if h.state.admission.num_sequences == 64:
            break
        await asyncio.sleep(0.01)
    for path, status in (("/v1/chat/completions", 429), ("/v1/messages", 529)):
        response = await h.post(path, {"messages": HI, "max_tokens": 2})
        assert response.status == status and response.headers["Retry-After"] == "1"
    assert (await held).status == 200
    assert (await h.post("/v1/chat/completions", {"messages": HI})).status == 200


async def test_the_gate_serves_tenants_then_requests_in_turn():
    gate = FairGate(1)
    await gate.acquire("a", 0)  # holds the only slot
    order = []

    async def wait(tenant: str, flow: int, name: str) -> None:
        await gate.acquire(tenant, flow)
        order.append(name)

    tasks = [asyncio.create_task(wait("a", 0, f"a0-{i}")) for i in range(3)]
    tasks += [asyncio.create_task(wait("a", 1, "a1")), asyncio.create_task(wait("b", 2, "b"))]
    await asyncio.sleep(0)
    for _ in range(5):
        gate.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["a0-0", "b", "a1", "a0-1", "a0-2"]


async def test_a_waiter_that_leaves_gives_up_its_place():
    gate = FairGate(1)
    await gate.acquire("a", 0)
    leaving = asyncio.create_task(gate.acquire("b", 1))
    staying = asyncio.create_task(gate.acquire("c", 2))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    gate.release()
    await asyncio.wait_for(staying, 1)
    assert gate.num_used == 1 and gate.num_waiting == 0


def test_reservations_count_sequences_and_prompt_tokens():
    admission = Admission(Limits(8, 10, 100, 4), Metrics())
    first = admission.admit().reserve(Work(6, 60))
    with pytest.raises(ApiError) as overloaded:
        admission.admit().reserve(Work(5, 10))
    assert overloaded.value.kind == "overloaded"
    with pytest.raises(ApiError) as too_large:
        admission.admit().reserve(Work(1, 101))
    assert too_large.value.kind == "invalid_request"
    first.release()
    first.release()  # idempotent
    assert (admission.num_sequences, admission.num_prompt_tokens) == (0, 0)
    admission.admit().reserve(Work(10, 100))


def test_a_ticket_holds_its_slot_and_work_until_it_closes():
    admission = Admission(Limits(1, 10, 100, 4), Metrics())
    with admission.admit() as ticket:
        ticket.reserve(Work(3, 30))
        assert (admission.num_active, admission.num_sequences) == (1, 3)
        with pytest.raises(ApiError) as overloaded:
            admission.admit()  # the one request slot is held
        assert overloaded.value.kind == "overloaded"
        with pytest.raises(RuntimeError):
            ticket.reserve(Work(1, 1))  # once per request
    assert (admission.num_active, admission.num_sequences, admission.num_prompt_tokens) == \
        (0, 0, 0)
    ticket.close()  # idempotent
    assert admission.num_active == 0


@pytest.mark.parametrize("draining, ready, reason", [(True, False, "draining"),
                                                     (False, False, "not_ready")])
async def test_draining_comes_before_not_ready(draining, ready, reason):
    metrics = Metrics()
    admission = Admission(Limits(1, 10, 100, 4), metrics, is_ready=lambda: ready)
    if draining:
        assert await admission.drain(0.01) is True  # nothing in flight
    with pytest.raises(ApiError) as refused:
        admission.admit()
    assert refused.value.kind == "unavailable" and admission.num_active == 0
    assert metrics.registry.get_sample_value("duplex_requests_rejected_total",
                                             {"reason": reason}) == 1

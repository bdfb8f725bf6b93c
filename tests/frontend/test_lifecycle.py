"""Lifecycle over fakes: admission (429/529), disconnects abort, worker death, drain,
timeouts, health, API keys."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from frontend_fakes import FakeEngineClient

HI = [{"role": "user", "content": "hi"}]
CHAT = {"messages": HI}
MESSAGE = {"model": "fake-model", "max_tokens": 20, "messages": HI}


async def wait_for(predicate, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def sse_data(response) -> list[str]:
    return [line[6:] for line in (await response.text()).split("\n") if line.startswith("data: ")]


# ---------------------------------------------------------------- admission
async def test_overload_is_refused_fast_with_retry_after(make_harness):
    engine = FakeEngineClient()
    engine.hang = True
    h = await make_harness(engine, max_queued_requests=2)
    busy = [asyncio.create_task(h.post("/v1/chat/completions", CHAT)) for _ in range(2)]
    await wait_for(lambda: h.state.admission.num_active == 2)
    start = time.perf_counter()
    response = await h.post("/v1/chat/completions", CHAT)
    assert time.perf_counter() - start < 0.5
    assert response.status == 429 and response.headers["Retry-After"] == "1"
    assert (await response.json())["error"]["type"] == "rate_limit_error"
    response = await h.post("/v1/messages", MESSAGE)
    assert response.status == 529 and response.headers["Retry-After"] == "1"
    body = await response.json()
    assert body == {"type": "error", "error": {"type": "overloaded_error",
                                               "message": body["error"]["message"]}}
    async with h.client.ws_connect("/v1/ws") as socket:
        await socket.send_json({"type": "chat", "id": "o", "messages": HI})
        frame = await socket.receive_json()
        assert (frame["type"], frame["code"]) == ("error", "overloaded")
    engine.hang = False
    assert [r.status for r in await asyncio.gather(*busy)] == [200, 200]
    response = await h.post("/v1/chat/completions", CHAT)
    assert response.status == 200


async def test_engine_not_ready_is_503_and_health_follows(harness):
    response = await harness.client.get("/health")
    assert response.status == 200 and (await response.json())["status"] == "ok"
    harness.engine.ready = False
    response = await harness.client.get("/health")
    assert response.status == 503 and (await response.json())["status"] == "unavailable"
    response = await harness.post("/v1/chat/completions", CHAT)
    assert response.status == 503 and "Retry-After" in response.headers
    response = await harness.post("/v1/messages", MESSAGE)
    assert response.status == 503 and (await response.json())["type"] == "error"
    harness.engine.ready = True
    assert (await harness.client.get("/health")).status == 200


# ---------------------------------------------------------------- disconnects
async def test_non_streaming_disconnect_aborts(make_harness):
    engine = FakeEngineClient()
    engine.hang = True
    h = await make_harness(engine)
    request = asyncio.create_task(h.post("/v1/chat/completions", CHAT))
    await wait_for(lambda: engine.active)
    request.cancel()  # the client goes away: its connection closes
    await wait_for(lambda: len(engine.aborted) == 1)
    await wait_for(lambda: h.state.admission.num_active == 0)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {**CHAT, "stream": True}),
                                        ("/v1/completions", {"prompt": "a", "stream": True,
                                                             "max_tokens": 100}),
                                        ("/v1/messages", {**MESSAGE, "stream": True})])
async def test_streaming_disconnect_aborts(make_harness, path, body):
    engine = FakeEngineClient(step_s=0.02)
    h = await make_harness(engine)
    async with aiohttp.ClientSession() as session:
        async with session.post(h.client.make_url(path), json=body) as response:
            await response.content.readline()
    await wait_for(lambda: len(engine.aborted) == 1)
    await wait_for(lambda: h.state.admission.num_active == 0)


async def test_disconnect_of_n_choices_aborts_every_child(make_harness):
    engine = FakeEngineClient(step_s=0.02)
    h = await make_harness(engine)
    async with aiohttp.ClientSession() as session:
        async with session.post(h.client.make_url("/v1/chat/completions"),
                                json={**CHAT, "n": 3, "stream": True}) as response:
            await response.content.readline()
    await wait_for(lambda: len(engine.aborted) == 3)


# ---------------------------------------------------------------- worker death
async def test_worker_death_openai_stream_gets_one_error_then_done(make_harness):
    engine = FakeEngineClient()
    engine.fail_after = 3
    h = await make_harness(engine)
    payloads = await sse_data(await h.post("/v1/chat/completions", {**CHAT, "stream": True}))
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    errors = [json.loads(p) for p in payloads[:-1] if "error" in json.loads(p)]
    assert len(errors) == 1 and payloads[-2] == json.dumps(errors[0], separators=(",", ":"))
    assert errors[0]["error"]["message"] == "worker died"
    contents = "".join(json.loads(p)["choices"][0]["delta"].get("content") or ""
                       for p in payloads[:-2])
    assert contents == "Hel"


async def test_worker_death_anthropic_stream_ends_with_one_error_event(make_harness):
    engine = FakeEngineClient()
    engine.fail_after = 3
    h = await make_harness(engine)
    text = await (await h.post("/v1/messages", {**MESSAGE, "stream": True})).text()
    events = [line[7:] for line in text.split("\n") if line.startswith("event: ")]
    assert events[-1] == "error" and events.count("error") == 1
    assert "message_stop" not in events and "message_delta" not in events


async def test_worker_death_non_streaming_is_503(make_harness):
    engine = FakeEngineClient()
    engine.fail_after = 1
    h = await make_harness(engine)
    response = await h.post("/v1/chat/completions", CHAT)
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "error"
    response = await h.post("/v1/messages", MESSAGE)
    assert response.status == 503 and (await response.json())["type"] == "error"


async def test_worker_death_with_n_choices_ends_stream_once(make_harness):
    engine = FakeEngineClient()
    engine.fail_after = 2
    h = await make_harness(engine)
    payloads = await sse_data(await h.post("/v1/chat/completions",
                                           {**CHAT, "n": 3, "stream": True}))
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    assert sum("error" in json.loads(p) for p in payloads[:-1]) == 1


# ---------------------------------------------------------------- drain and timeouts
async def test_drain_refuses_new_requests_and_lets_in_flight_finish(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.01))
    in_flight = asyncio.create_task(h.post("/v1/chat/completions", CHAT))
    await wait_for(lambda: h.engine.active)
    drain = asyncio.create_task(h.state.admission.drain(5.0))
    await wait_for(lambda: h.state.admission.draining)
    response = await h.post("/v1/chat/completions", CHAT)
    assert response.status == 503
    assert (await h.client.get("/health")).status == 503
    assert (await (await in_flight).json())["choices"][0]["finish_reason"] == "stop"
    assert await drain is True


async def test_drain_times_out_when_requests_outlast_it(make_harness):
    engine = FakeEngineClient()
    engine.hang = True
    h = await make_harness(engine)
    request = asyncio.create_task(h.post("/v1/chat/completions", CHAT))
    await wait_for(lambda: engine.active)
    assert await h.state.admission.drain(0.05) is False
    request.cancel()


async def test_request_timeout_is_504_and_aborts(make_harness):
    engine = FakeEngineClient(step_s=0.05)
    h = await make_harness(engine, request_timeout_s=0.12)
    response = await h.post("/v1/chat/completions", CHAT)
    assert response.status == 504
    assert (await response.json())["error"]["code"] == "timeout"
    assert engine.added[0].deadline == pytest.approx(engine.added[0].arrival_time + 0.12)


async def test_frontend_cuts_off_a_worker_that_ignores_the_deadline(make_harness, monkeypatch):
    monkeypatch.setattr("duplex.frontend.generation.DEADLINE_GRACE_S", 0.05)
    engine = FakeEngineClient()
    engine.hang = True
    h = await make_harness(engine, request_timeout_s=0.05)
    response = await h.post("/v1/chat/completions", CHAT)
    assert response.status == 504
    await wait_for(lambda: len(engine.aborted) == 1)


# ---------------------------------------------------------------- API keys
async def test_api_keys(make_harness):
    h = await make_harness(api_keys=("k1", "k2"))
    response = await h.post("/v1/chat/completions", CHAT)
    assert response.status == 401
    assert (await response.json())["error"]["code"] == "invalid_api_key"
    response = await h.post("/v1/messages", MESSAGE)
    assert response.status == 401
    assert (await response.json())["error"]["type"] == "authentication_error"
    response = await h.post("/v1/chat/completions", CHAT, headers={"Authorization": "Bearer k2"})
    assert response.status == 200
    response = await h.post("/v1/messages", MESSAGE, headers={"x-api-key": "k1"})
    assert response.status == 200
    response = await h.post("/v1/chat/completions", CHAT, headers={"Authorization": "Bearer no"})
    assert response.status == 401
    for path in ("/health", "/"):
        assert (await h.client.get(path)).status == 200
    assert (await h.client.get("/v1/models")).status == 401
    async with h.client.ws_connect("/v1/ws", headers={"x-api-key": "k1"}) as socket:
        await socket.send_json({"type": "ping"})
        assert (await socket.receive_json())["type"] == "pong"
    with pytest.raises(aiohttp.WSServerHandshakeError):
        await h.client.ws_connect("/v1/ws")


async def test_tenant_salt_separates_api_keys(make_harness):
    h = await make_harness(api_keys=("k1", "k2"))
    for key in ("k1", "k2"):
        await h.post("/v1/chat/completions", {**CHAT, "cache_salt": "s"},
                     headers={"Authorization": f"Bearer {key}"})
    salts = [m.cache_salt for m in h.engine.added]
    assert salts[0] != salts[1] and all(s.endswith(":s") for s in salts)

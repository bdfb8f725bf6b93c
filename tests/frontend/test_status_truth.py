"""Status codes that tell the truth: a request that can never fit gets a 400 naming the limit
in each API's shape (no Retry-After); only conditions that pass are 429/503/529."""
from __future__ import annotations

import msgspec
from frontend_fakes import FakeEngineClient

from duplex.engine.messages import INVALID, RequestDelta

HI = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "x" * 100}]  # fits the 512-token context, not 2 blocks


def small_pool_engine() -> FakeEngineClient:
    engine = FakeEngineClient()
    engine.ready_info = msgspec.structs.replace(engine.ready_info, num_kv_blocks=2)  # 32 tokens
    return engine


class RefusingEngine(FakeEngineClient):
    """A worker that refuses every request as invalid (its own field checks failed)."""

    async def _deltas(self, msg):
        yield RequestDelta(msg.req_id, [], finish_reason="error", error_kind=INVALID,
                           error="stop_token_ids outside the vocabulary [0, 266): [9999]")


async def test_prompt_over_the_kv_pool_is_400_in_both_shapes(make_harness):
    h = await make_harness(small_pool_engine())
    for path, body in (("/v1/chat/completions", {"messages": LONG}),
                       ("/v1/chat/completions", {"messages": LONG, "stream": True}),
                       ("/v1/completions", {"prompt": "x" * 100})):
        response = await h.post(path, body)
        assert response.status == 400 and "Retry-After" not in response.headers
        error = (await response.json())["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "kv_pool_exceeded"
        assert "KV cache pool holds 32 tokens" in error["message"]
    for stream in (False, True):
        response = await h.post("/v1/messages", {"messages": LONG, "max_tokens": 5,
                                                 "stream": stream})
        assert response.status == 400 and "Retry-After" not in response.headers
        body = await response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "32 tokens" in body["error"]["message"]
    assert not h.engine.added  # refused before anything reached a worker
    assert (await h.post("/v1/chat/completions", {"messages": HI})).status == 200


async def test_prompt_over_the_kv_pool_on_the_websocket(make_harness):
    h = await make_harness(small_pool_engine())
    async with h.client.ws_connect("/v1/ws") as socket:
        await socket.send_json({"type": "chat", "id": "big", "messages": LONG})
        frame = await socket.receive_json()
    assert (frame["type"], frame["id"], frame["code"]) == ("error", "big", "invalid_request")
    assert "32 tokens" in frame["message"]


async def test_a_request_the_worker_refuses_as_invalid_is_400_not_503(make_harness):
    h = await make_harness(RefusingEngine())
    response = await h.post("/v1/chat/completions", {"messages": HI})
    assert response.status == 400 and "Retry-After" not in response.headers
    assert "outside the vocabulary" in (await response.json())["error"]["message"]
    response = await h.post("/v1/messages", {"messages": HI, "max_tokens": 3})
    assert response.status == 400
    assert (await response.json())["error"]["type"] == "invalid_request_error"


async def test_a_lost_worker_stays_retryable(make_harness):
    engine = FakeEngineClient()
    engine.fail_after = 1
    h = await make_harness(engine)
    response = await h.post("/v1/chat/completions", {"messages": HI})
    assert response.status == 503 and response.headers["Retry-After"] == "1"

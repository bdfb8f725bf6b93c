"""Deeply nested JSON never gives a 5xx: every JSON endpoint answers 4xx in its API's shape,
and on the WebSocket the bad frame gets one error frame while the socket's other request
finishes."""
from __future__ import annotations

import json

import msgspec
import pytest
from frontend_fakes import FakeEngineClient
from test_ws import receive_until_terminal

from duplex.frontend.body_limits import MAX_JSON_DEPTH, check_depth, json_depth
from duplex.frontend.errors import ApiError
from duplex.frontend.protocol import ChatCompletionRequest, WsServerFrame, decode_json

HI = [{"role": "user", "content": "hi"}]
DEPTHS = [10**2, 10**3, 10**4, 10**5, 10**6]
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages",
             "/v1/messages/count_tokens", "/tokenize"]


def nested(depth: int) -> str:
    """Arrays and objects alternating, `depth` levels: [{"a":[{"a":...}]}]."""
    half = depth // 2
    return '[{"a":' * half + "1" + "}]" * half


def bodies(depth: int) -> list[bytes]:
    """The nesting as the whole body, and inside a field each API takes as free JSON."""
    inner = nested(depth)
    return [inner.encode(),
            ('{"messages":%s,"max_tokens":2,"prompt":"a","metadata":{"x":%s}}'
             % (json.dumps(HI), inner)).encode()]


@pytest.mark.parametrize("depth", DEPTHS)
async def test_nested_bodies_get_4xx_on_every_endpoint(harness, depth):
    for path in ENDPOINTS:
        for body in bodies(depth):
            response = await harness.client.post(path, data=body, headers={
                "Content-Type": "application/json"})
            assert response.status < 500, (path, depth, await response.text())
            error = await response.json()
            if response.status >= 400 and path.startswith("/v1/messages"):
                assert error["type"] == "error" and error["error"]["type"] == \
                    "invalid_request_error"
            elif response.status >= 400:
                assert set(error["error"]) == {"message", "type", "param", "code"}
            if depth > MAX_JSON_DEPTH:  # refused before parsing, naming the limit
                assert response.status == 400, (path, depth)
                message = error["error"]["message"]
                assert f"limit of {MAX_JSON_DEPTH} levels" in message, message


async def test_nested_frames_on_the_websocket_spare_the_other_request(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.02))
    decode = msgspec.json.Decoder(WsServerFrame).decode
    async with h.client.ws_connect("/v1/ws") as socket:
        await socket.send_json({"type": "chat", "id": "long", "messages": HI, "max_tokens": 12})
        for depth in DEPTHS:
            await socket.send_str('{"type":"chat","id":"deep","messages":%s}' % nested(depth))
        errors, frames = [], {"long": []}
        while len(errors) < len(DEPTHS) or not frames["long"] or \
                type(frames["long"][-1]).__name__ != "WsDone":
            frame = decode(await socket.receive_str())
            if type(frame).__name__ == "WsError" and frame.id != "long":
                errors.append(frame)
            else:
                frames["long"].append(frame)
        assert all(e.code == "invalid_request" for e in errors)
        assert sum(f"limit of {MAX_JSON_DEPTH} levels" in e.message for e in errors) == 4
        assert frames["long"][-1].finish_reason == "length"
        assert sum(f.num_tokens for f in frames["long"][:-1]) == 12
        await socket.send_json({"type": "chat", "id": "after", "messages": HI, "max_tokens": 2})
        assert (await receive_until_terminal(socket, {"after"}))["after"][-1].finish_reason \
            == "length"


def test_depth_scan_ignores_brackets_inside_strings():
    assert json_depth(b'{"a": "[[[[{{{{", "b": [1, [2]]}') == 3
    assert json_depth(rb'["\"[[[[", [[]]]') == 3
    assert json_depth(b"5") == 0
    check_depth(b'"' + b"[" * 10_000 + b'"')  # a string of brackets is not deep
    with pytest.raises(ValueError, match="limit of 4 levels"):
        check_depth(b"[" * 5 + b"]" * 5, limit=4)
    check_depth(b"[" * 4 + b"]" * 4, limit=4)


def test_decode_json_raises_only_api_errors_at_any_depth():
    for depth in (100, MAX_JSON_DEPTH, 5_000):  # plus 6 levels around it
        body = '{"messages":[{"role":"user","content":"x"}],"tools":[{"function":{"name":"f",' \
               '"parameters":{"p":%s}}}]}' % nested(depth)
        if depth + 6 <= MAX_JSON_DEPTH:
            decode_json(body, ChatCompletionRequest)
        else:
            with pytest.raises(ApiError):
                decode_json(body, ChatCompletionRequest)

"""Reasoning on the WebSocket: thinking in each delta's `reasoning`, the answer in `text`,
`usage.reasoning_tokens` in the done frame, the thinking budget; frames match the schema."""
from __future__ import annotations

import json

import jsonschema
import pytest
from reasoning_support import start_server

from duplex.frontend.protocol import ws_json_schema


@pytest.fixture
async def clients():
    started: list = []
    yield started
    for client in started:
        await client.close()


async def run_chat(client, **fields) -> list[dict]:
    frames = []
    async with client.ws_connect("/v1/ws") as socket:
        await socket.send_str(json.dumps({"type": "chat", "id": "a", **fields}))
        while not frames or frames[-1]["type"] == "delta":
            frames.append(json.loads((await socket.receive()).data))
    return frames


def server_validator():
    schema = ws_json_schema()
    return jsonschema.Draft202012Validator({**schema, "$ref": "#/properties/server"})


async def test_ws_reasoning_and_text_apart(clients, recipes):
    _, client = await start_server(recipes["r1"], lambda p, o: "Two and two.\n</think>\n\nFour.",
                                   clients)
    frames = await run_chat(client, max_tokens=50, messages=[{"role": "user", "content": "2+2?"}])
    validator = server_validator()
    for frame in frames:
        validator.validate(frame)
    deltas, done = frames[:-1], frames[-1]
    assert "".join(f["reasoning"] for f in deltas) == "Two and two."
    assert "".join(f["text"] for f in deltas) == "Four."
    assert done["type"] == "done" and done["finish_reason"] == "stop"
    thinking_ids = recipes["r1"].encode_reply_start("Two and two.\n</think>")
    assert done["usage"]["reasoning_tokens"] == len(thinking_ids)


async def test_ws_thinking_budget_and_bad_budget(clients, recipes):
    state, client = await start_server(
        recipes["r1"], lambda p, o: "Yes." if "</think>" in o else "step " * 60, clients)
    frames = await run_chat(client, max_tokens=30, thinking_budget=2,
                            messages=[{"role": "user", "content": "go"}])
    assert "".join(f.get("reasoning", "") for f in frames[:-1]) == "step step"
    assert "".join(f.get("text", "") for f in frames[:-1]) == "Yes."
    bad = await run_chat(client, max_tokens=30, thinking_budget=31,
                         messages=[{"role": "user", "content": "go"}])
    assert bad == [{"type": "error", "id": "a", "code": "invalid_request",
                    "message": "thinking_budget is 31, more than max_tokens (30)"}]

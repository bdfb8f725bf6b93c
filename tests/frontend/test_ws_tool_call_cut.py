"""A tool call cut by max_tokens on the WebSocket (docs/websocket.md): the protocol carries
text only (a chat frame has no `tools`; unknown fields are ignored, so none are parsed), so
a call the model writes arrives as the text it wrote, and a cut one is never completed: its
text stops where max_tokens cut it, nothing is appended, and the done frame says `length`
(a whole call ends with `stop`). The model is steered (steered_support.py)."""
from __future__ import annotations

import json

import pytest
from steered_support import recipe_grammars, start_server, tools_recipe

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return tools_recipe(tmp_path_factory.mktemp("tools_recipe"))


@pytest.fixture
async def client(recipe):
    grammars = recipe_grammars(recipe)
    started: list = []
    _, client = await start_server(recipe, lambda prompt: CALL, grammars, started)
    yield client
    await client.close()
    grammars.close()


async def run_chat(client, max_tokens: int) -> list[dict]:
    frames = []
    async with client.ws_connect("/v1/ws") as socket:
        await socket.send_str(json.dumps({
            "type": "chat", "id": "a", "max_tokens": max_tokens, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}))
        while not frames or frames[-1]["type"] == "delta":
            frames.append(json.loads((await socket.receive()).data))
    return frames


async def test_a_call_cut_by_max_tokens_arrives_cut_with_length(client, recipe):
    ids = recipe.encode_reply_start(CALL)
    cut = next(k for k in range(len(ids)) if '"Pa' in recipe.decode(ids[:k]))  # mid-city
    *deltas, done = await run_chat(client, max_tokens=cut)
    text = "".join(f["text"] for f in deltas)
    assert text == recipe.decode(ids[:cut]) and '"Pa' in text and '"Paris"' not in text
    assert (done["type"], done["finish_reason"]) == ("done", "length")
    assert done["usage"]["completion_tokens"] == cut == sum(f["num_tokens"] for f in deltas)


async def test_a_whole_call_arrives_whole_with_stop(client):
    *deltas, done = await run_chat(client, max_tokens=200)
    assert "".join(f["text"] for f in deltas) == CALL
    assert (done["type"], done["finish_reason"]) == ("done", "stop")

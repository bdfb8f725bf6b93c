"""litellm against a local server as `openai/<model>` with api_base: completion and
streaming give the model's text and finish, and a tool call comes back parsed.

litellm is not in the lock: it requires boto3, whose botocore pins python-dateutil<3 (the
lock has 4.0.0, matplotlib's), it brings the AWS SDK and a dozen more packages, and its
import alone takes ~14 s on a small box; the module is skipped unless litellm was installed
by hand, e.g. beside the venv (1.110.2 passes):
    pip install --no-deps --target /tmp/clients litellm==1.110.2 fastuuid python-dotenv \
        pydantic-settings 'importlib-metadata<9' zipp h2 hpack hyperframe
    PYTHONPATH=/tmp/clients pytest tests/thirdparty/test_litellm.py
"""
from __future__ import annotations

import json

import pytest
from thirdparty_support import MODEL, call, writes

litellm = pytest.importorskip(
    "litellm", reason="litellm not installed: its boto3 needs python-dateutil<3, the lock "
    "has 4.0.0")
TEXT = "Paris is the capital of France."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def complete(server, **kwargs):
    return litellm.completion(model="openai/" + MODEL, api_base=server.url + "/v1",
                              api_key="none", messages=ASK, max_tokens=100, num_retries=0,
                              **kwargs)


def test_completion_and_stream_give_the_text(server, recipe):
    server.script = writes(TEXT)
    reply = complete(server)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (TEXT, "stop")
    assert reply.usage.completion_tokens == len(recipe.encode_reply_start(TEXT))
    chunks = list(complete(server, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        ["stop"]


def test_a_tool_call_comes_back_parsed(server):
    server.script = writes(call("get_weather", '{"city": "Paris"}'))
    reply = complete(server, tools=TOOLS)
    [tool_call] = reply.choices[0].message.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    assert reply.choices[0].finish_reason == "tool_calls"
    chunks = list(complete(server, tools=TOOLS, stream=True))
    built = litellm.stream_chunk_builder(chunks)
    [streamed] = built.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == \
        ("get_weather", '{"city": "Paris"}')
    assert not built.choices[0].message.content

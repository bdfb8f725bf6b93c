"""Hypothesis fuzzing of every JSON endpoint: whatever the body, never a 5xx, and every
4xx is in the called API's error shape. The server runs on its own loop in a thread."""
from __future__ import annotations

import asyncio
import collections
import json
import threading

import pytest
import requests
from aiohttp import web
from frontend_fakes import FakeEngineClient, FakeRecipe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.server import AppState, ServerOptions, build_app

STATUSES: collections.Counter = collections.Counter()  # (path, status) -> count
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                          max_leaves=12)
def mostly(valid):
    """Valid seven times in eight, any JSON value otherwise."""
    return st.integers(0, 7).flatmap(lambda i: json_value if i == 3 else valid)


text = st.text(max_size=12)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "user", "wizard"])
content = mostly(text | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image_url"]), "text": text}), max_size=2))
tool_call = st.fixed_dictionaries({"id": text, "type": st.just("function"), "function":
                                   st.fixed_dictionaries({"name": text, "arguments": text})})
message = st.fixed_dictionaries({"role": roles, "content": content}, optional={
    "tool_call_id": mostly(text), "name": mostly(text),
    "tool_calls": mostly(st.lists(tool_call, max_size=1))})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": text}, optional={"description": text, "parameters": st.just({"type": "object"})})})
sampling = {
    "max_tokens": mostly(st.integers(1, 30)), "temperature": mostly(st.floats(0, 2)),
    "top_p": mostly(st.floats(0.01, 1)), "top_k": mostly(st.integers(-1, 50)),
    "min_p": mostly(st.floats(0, 1)), "seed": mostly(st.integers(0, 2**40)),
    "n": mostly(st.integers(1, 3)),
    "stop": mostly(st.text(min_size=1, max_size=3)
                   | st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "presence_penalty": mostly(st.floats(-2, 2)), "repetition_penalty": mostly(st.floats(0, 2)),
    "stream": mostly(st.booleans()), "ignore_eos": mostly(st.booleans()),
    "retention": st.sampled_from(["chat", "agent", "x"])}
chat_body = st.fixed_dictionaries({"messages": mostly(st.lists(message, min_size=1,
                                                               max_size=3))}, optional={
    **sampling, "model": st.sampled_from(["fake-model", "x"]),
    "logprobs": mostly(st.booleans()), "top_logprobs": mostly(st.integers(0, 5)),
    "max_completion_tokens": mostly(st.integers(1, 30)),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "tools": mostly(st.lists(tool, max_size=2)),
    "tool_choice": mostly(st.sampled_from(["none", "auto", "required"]))})
completion_body = st.fixed_dictionaries({"prompt": mostly(
    text | st.lists(st.integers(0, 300), min_size=1, max_size=4)
    | st.lists(text, min_size=1, max_size=3))}, optional={
    **sampling, "echo": mostly(st.booleans()), "logprobs": mostly(st.integers(0, 5)),
    "suffix": st.none() | text})
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": mostly(text)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text,
                           "input": mostly(st.dictionaries(text, text, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text},
                          optional={"content": mostly(text)}),
    st.fixed_dictionaries({"type": text}, optional={"source": json_value}))
anthropic_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "user", "x"]),
    "content": mostly(text | st.lists(block, min_size=1, max_size=2))})
anthropic_tool = st.fixed_dictionaries({"name": text, "input_schema": st.just(
    {"type": "object"})}, optional={"description": text})
messages_body = st.fixed_dictionaries({
    "messages": mostly(st.lists(anthropic_message, min_size=1, max_size=3)),
    "max_tokens": mostly(st.integers(1, 30))}, optional={
    "system": mostly(text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                            "text": text}), max_size=2)),
    "stop_sequences": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "temperature": mostly(st.floats(0, 1)), "top_k": mostly(st.integers(0, 10)),
    "stream": mostly(st.booleans()), "tools": mostly(st.lists(anthropic_tool, max_size=2)),
    "tool_choice": mostly(st.fixed_dictionaries({"type": st.sampled_from(
        ["auto", "any", "none", "tool"])}, optional={"name": text})),
    "model": st.sampled_from(["fake-model", "fake-model", "claude"])})
raw_body = st.binary(max_size=40) | json_value.map(lambda v: json.dumps(v).encode())


@pytest.fixture(scope="module")
def server_url():
    loop = asyncio.new_event_loop()
    state = AppState(FakeEngineClient(max_model_len=256), FakeRecipe(), ServerOptions())
    runner = web.AppRunner(build_app(state), handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def check(url: str, path: str, body: bytes | dict) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = requests.post(url + path, data=data, timeout=10,
                             headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (path, body, response.text)
    STATUSES[path, response.status_code] += 1
    if response.status_code >= 400:
        error = response.json()
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}
    elif b"text/event-stream" in response.headers["Content-Type"].encode():
        assert response.text.rstrip().endswith(("data: [DONE]", "message_stop\"}"))


@SETTINGS
@given(body=chat_body)
def test_fuzz_chat(server_url, body):
    check(server_url, "/v1/chat/completions", body)


@SETTINGS
@given(body=completion_body)
def test_fuzz_completions(server_url, body):
    check(server_url, "/v1/completions", body)


@SETTINGS
@given(body=messages_body)
def test_fuzz_messages(server_url, body):
    check(server_url, "/v1/messages", body)
    check(server_url, "/v1/messages/count_tokens", body)


@SETTINGS
@given(body=raw_body, path=st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                            "/v1/messages", "/tokenize"]))
def test_fuzz_raw_bodies(server_url, body, path):
    check(server_url, path, body)



def test_fuzzing_reached_the_engine():
    """Runs after the fuzz tests above: a good share of bodies must be valid, or the fuzzing
    only exercised validation."""
    if not STATUSES:
        pytest.skip("run with the fuzz tests")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        assert STATUSES[path, 200] >= 10, sorted(STATUSES.items())

"""Bad input -> a 4xx in the called API's own error shape, naming the field; never a 500."""
from __future__ import annotations

import json

import pytest

HI = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "x" * 600}]  # over the fake's 512-token context

# (case, body, status, param). Bodies given as bytes are sent raw.
CHAT_CASES = [
    ("malformed json", b'{"messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("empty body", b"", 400, None),
    ("invalid utf-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("lone surrogate", rb'{"messages": [{"role": "user", "content": "\ud800"}]}', 400, None),
    ("missing messages", {"model": "fake-model"}, 400, "messages"),
    ("messages wrong type", {"messages": "hi"}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("missing role", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0].type"),
    ("user without content", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("tool_calls on a user turn", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
     "messages[0].tool_calls"),
    ("max_tokens as string", {"messages": HI, "max_tokens": "5"}, 400, "max_tokens"),
    ("negative max_tokens", {"messages": HI, "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", {"messages": HI, "max_tokens": 10**6}, 400, "max_tokens"),
    ("max_tokens over 64 bits", {"messages": HI, "max_tokens": 10**30}, 400, "max_tokens"),
    ("huge max_completion_tokens", {"messages": HI, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens"),
    ("n over the bound", {"messages": HI, "n": 9}, 400, "n"),
    ("n zero", {"messages": HI, "n": 0}, 400, "n"),
    ("prompt over context", {"messages": LONG}, 400, "messages"),
    ("temperature negative", {"messages": HI, "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"messages": HI, "top_p": 0}, 400, "top_p"),
    ("temperature as bool", {"messages": HI, "temperature": True}, 400, "temperature"),
    ("stop wrong type", {"messages": HI, "stop": 5}, 400, "stop"),
    ("empty stop string", {"messages": HI, "stop": [""]}, 400, "stop"),
    ("top_logprobs too many", {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400,
     "logprobs"),
    ("top_logprobs without logprobs", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    ("seed negative", {"messages": HI, "seed": -5}, 400, "seed"),
    ("bad retention", {"messages": HI, "retention": "forever"}, 400, "retention"),
    ("unknown model", {"messages": HI, "model": "gpt-9"}, 404, "model"),
    ("tool_choice names unknown tool", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("chat_template off by default", {"messages": HI, "chat_template":
                                      "{{ ''.__class__.__mro__[1].__subclasses__() }}"}, 400,
     "chat_template"),
]

COMPLETION_CASES = [
    ("missing prompt", {"max_tokens": 3}, 400, "prompt"),
    ("suffix", {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("mixed prompt list", {"prompt": ["a", 5]}, 400, "prompt"),
    ("empty prompt list", {"prompt": []}, 400, "prompt"),
    ("empty prompt", {"prompt": ""}, 400, "messages"),
    ("negative token id", {"prompt": [1, -2]}, 400, "prompt[1]"),
    ("token id over vocab", {"prompt": [1, 5000]}, 400, "prompt"),
    ("best_of", {"prompt": "a", "best_of": 3}, 400, "best_of"),
    ("logprobs too many", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
]

ANTHROPIC_CASES = [
    ("malformed json", b"{", 400),
    ("missing max_tokens", {"model": "fake-model", "messages": HI}, 400),
    ("zero max_tokens", {"model": "fake-model", "messages": HI, "max_tokens": 0}, 400),
    ("huge max_tokens", {"model": "fake-model", "messages": HI, "max_tokens": 10**6}, 400),
    ("system role in messages", {"messages": [{"role": "system", "content": "x"}],
                                 "max_tokens": 5}, 400),
    ("unknown block type", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}], "max_tokens": 5}, 400),
    ("tool_use in a user turn", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "1", "name": "f", "input": {}}]}], "max_tokens": 5}, 400),
    ("empty messages", {"messages": [], "max_tokens": 5}, 400),
    ("prompt over context", {"messages": LONG, "max_tokens": 5}, 400),
    ("bad temperature", {"messages": HI, "max_tokens": 5, "temperature": -2}, 400),
    ("unknown model", {"model": "claude-x", "messages": HI, "max_tokens": 5}, 404),
]


async def _send(harness, path, body):
    if isinstance(body, bytes):
        return await harness.client.post(path, data=body,
                                         headers={"Content-Type": "application/json"})
    return await harness.post(path, body)


def assert_openai_error(body: dict, param) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


def assert_anthropic_error(body: dict) -> None:
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]


@pytest.mark.parametrize("case, body, status, param", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
async def test_chat_bad_input(harness, case, body, status, param):
    response = await _send(harness, "/v1/chat/completions", body)
    assert response.status == status, await response.text()
    assert_openai_error(await response.json(), param)
    assert not harness.engine.added


@pytest.mark.parametrize("case, body, status, param", COMPLETION_CASES,
                         ids=[c[0] for c in COMPLETION_CASES])
async def test_completion_bad_input(harness, case, body, status, param):
    response = await _send(harness, "/v1/completions", body)
    assert response.status == status, await response.text()
    assert_openai_error(await response.json(), param)


@pytest.mark.parametrize("case, body, status", ANTHROPIC_CASES,
                         ids=[c[0] for c in ANTHROPIC_CASES])
async def test_anthropic_bad_input(harness, case, body, status):
    response = await _send(harness, "/v1/messages", body)
    assert response.status == status, await response.text()
    assert_anthropic_error(await response.json())


async def test_oversized_body_is_413_in_each_shape(make_harness):
    h = await make_harness(client_max_size=4096)
    big = {"messages": [{"role": "user", "content": "x" * 10_000}], "max_tokens": 5}
    response = await h.post("/v1/chat/completions", big)
    assert response.status == 413
    assert_openai_error(await response.json(), None)
    response = await h.post("/v1/messages", big)
    assert response.status == 413
    assert_anthropic_error(await response.json())


async def test_unknown_route_and_wrong_method(harness):
    response = await harness.client.get("/v1/nothing")
    assert response.status == 404
    assert_openai_error(await response.json(), None)
    response = await harness.client.get("/v1/chat/completions")
    assert response.status == 405
    assert_openai_error(await response.json(), None)
    response = await harness.client.get("/v1/messages")
    assert response.status == 405
    assert_anthropic_error(await response.json())


async def test_validation_message_names_the_field(harness):
    response = await harness.post("/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "a"}, {"role": 3}]})
    error = (await response.json())["error"]
    assert error["param"] == "messages[1].role" and "messages[1].role" in error["message"]
    assert error["type"] == "invalid_request_error"


async def test_context_length_error_code(harness):
    response = await harness.post("/v1/chat/completions", {"messages": LONG})
    assert (await response.json())["error"]["code"] == "context_length_exceeded"
    response = await harness.post("/v1/chat/completions", {"messages": HI, "max_tokens": 500})
    assert (await response.json())["error"]["code"] == "context_length_exceeded"


async def test_bad_input_is_never_logged_as_unhandled(harness, caplog):
    for _, body, _, _ in CHAT_CASES:
        await _send(harness, "/v1/chat/completions", body)
    assert not [r for r in caplog.records if "unhandled" in r.getMessage()]
    assert json.dumps(body)  # the table is plain JSON-able data


async def test_request_chat_template_only_when_the_operator_allows_it(make_harness):
    body = {"messages": HI, "chat_template": "plain {{ messages }}"}
    closed = await make_harness()
    response = await closed.post("/v1/chat/completions", body)
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "chat_template_disabled"
    assert not closed.recipe.chat_calls  # refused before rendering anything
    opened = await make_harness(allow_request_chat_template=True)
    assert (await opened.post("/v1/chat/completions", body)).status == 200
    assert opened.recipe.chat_calls[-1]["template"] == "plain {{ messages }}"
    hostile = {"messages": HI, "chat_template": "{{ ''.__class__.__mro__ }}"}
    response = await opened.post("/v1/chat/completions", hostile)
    assert response.status == 400 and (await response.json())["error"]["param"] == "messages"

"""Anthropic Messages API through the official `anthropic` SDK (async client), over fakes."""
from __future__ import annotations

import json

import anthropic
from frontend_fakes import FakeEngineClient

TOOL_REPLY = 'On it.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
WEATHER_TOOL = {"name": "get_weather", "description": "weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
HI = [{"role": "user", "content": "hi"}]


def sdk(h) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(h.client.make_url("")), api_key="none",
                                    max_retries=0)


async def sse_events(response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in (await response.text()).split("\n"):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


async def test_message_non_streaming(harness):
    message = await sdk(harness).messages.create(model="fake-model", max_tokens=64, messages=HI)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello there, friend!"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == len("<user>hi\n<assistant>")
    assert message.usage.output_tokens == len("Hello there, friend!")
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0


async def test_cached_tokens_are_read_tokens(make_harness):
    h = await make_harness(FakeEngineClient(num_cached=8))
    message = await sdk(h).messages.create(model="fake-model", max_tokens=64, messages=HI)
    assert message.usage.cache_read_input_tokens == 8
    assert message.usage.input_tokens == len("<user>hi\n<assistant>") - 8


async def test_streaming_event_sequence(harness):
    response = await harness.post("/v1/messages", {"model": "fake-model", "max_tokens": 64,
                                                   "messages": HI, "stream": True})
    events = await sse_events(response)
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"]["cache_read_input_tokens"] == 0 and start["content"] == []
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len("Hello there, friend!")


async def test_streaming_with_sdk_helper(make_harness):
    h = await make_harness(FakeEngineClient(num_cached=4))
    async with sdk(h).messages.stream(model="fake-model", max_tokens=64, messages=HI) as stream:
        text = "".join([t async for t in stream.text_stream])
        message = await stream.get_final_message()
    assert text == "Hello there, friend!"
    assert message.content[0].text == text
    assert message.usage.cache_read_input_tokens == 4
    assert message.usage.input_tokens == len("<user>hi\n<assistant>") - 4


async def test_stop_sequences_and_max_tokens(harness):
    message = await sdk(harness).messages.create(
        model="fake-model", max_tokens=64, messages=HI, stop_sequences=["friend"])
    assert message.content[0].text == "Hello there, "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "friend"
    message = await sdk(harness).messages.create(model="fake-model", max_tokens=3, messages=HI)
    assert message.content[0].text == "Hel" and message.stop_reason == "max_tokens"


async def test_sampling_fields_reach_the_engine(harness):
    # this SDK version no longer takes sampling fields as arguments; the API still does
    await sdk(harness).messages.create(model="fake-model", max_tokens=9, messages=HI,
                                       extra_body={"temperature": 0.3, "top_p": 0.8, "top_k": 4})
    p = harness.engine.added[-1].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (9, 0.3, 0.8, 4)


async def test_tool_use_non_streaming(make_harness):
    h = await make_harness(FakeEngineClient(reply=TOOL_REPLY))
    message = await sdk(h).messages.create(model="fake-model", max_tokens=200, messages=HI,
                                           tools=[WEATHER_TOOL])
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "On it."
    assert message.content[1].name == "get_weather"
    assert message.content[1].input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use"
    tools = h.recipe.chat_calls[-1]["tools"]
    assert tools[0]["function"]["parameters"] == WEATHER_TOOL["input_schema"]


async def test_tool_use_streaming(make_harness):
    h = await make_harness(FakeEngineClient(reply=TOOL_REPLY))
    async with sdk(h).messages.stream(model="fake-model", max_tokens=200, messages=HI,
                                      tools=[WEATHER_TOOL]) as stream:
        message = await stream.get_final_message()
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use"


async def test_conversion_of_system_blocks_and_tool_results(harness):
    await sdk(harness).messages.create(
        model="fake-model", max_tokens=20,
        system=[{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}],
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": [
                      {"type": "text", "text": "checking"},
                      {"type": "tool_use", "id": "t1", "name": "get_weather",
                       "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "t1",
                       "content": [{"type": "text", "text": "sunny"}]},
                      {"type": "text", "text": "thanks"}]}])
    messages = harness.recipe.chat_calls[-1]["messages"]
    assert messages[0] == {"role": "system", "content": "be\nbrief"}
    assert messages[2]["role"] == "assistant" and messages[2]["content"] == "checking"
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert messages[4] == {"role": "user", "content": "thanks"}


async def test_count_tokens(harness):
    count = await sdk(harness).messages.count_tokens(model="fake-model", messages=HI)
    assert count.input_tokens == len("<user>hi\n<assistant>")


async def test_unknown_model_is_404_in_anthropic_shape(harness):
    response = await harness.post("/v1/messages", {"model": "claude-x", "max_tokens": 5,
                                                   "messages": HI})
    assert response.status == 404
    body = await response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"


async def test_assistant_prefill_is_continued(harness):
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
    message = await sdk(harness).messages.create(model="fake-model", max_tokens=64,
                                                 messages=prefill)
    prompt = harness.engine.added[-1].prompt_token_ids
    assert prompt == harness.recipe.encode_prompt("<user>hi\n<assistant>Sure:")
    assert message.content[0].text == "Hello there, friend!"  # only the continuation
    count = await sdk(harness).messages.count_tokens(model="fake-model", messages=prefill)
    assert count.input_tokens == len(prompt)


async def test_assistant_prefill_with_trailing_whitespace_is_refused(harness):
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    try:
        await sdk(harness).messages.create(model="fake-model", max_tokens=64, messages=prefill)
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error"
        assert "trailing whitespace" in e.body["error"]["message"]
    else:
        raise AssertionError("a prefill ending in whitespace was accepted")
    assert not harness.engine.added


async def test_tool_choice_tool_forces_that_call(make_harness):
    h = await make_harness(FakeEngineClient(reply='{"city": "Oslo"}}\n</tool_call>'))
    message = await sdk(h).messages.create(
        model="fake-model", max_tokens=64, messages=HI, tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather"
    assert message.content[0].input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use"
    count = await sdk(h).messages.count_tokens(
        model="fake-model", messages=HI, tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"})
    assert count.input_tokens == len(h.engine.added[-1].prompt_token_ids)


async def test_tool_choice_naming_an_unknown_tool_is_refused(harness):
    try:
        await sdk(harness).messages.create(model="fake-model", max_tokens=64, messages=HI,
                                           tools=[WEATHER_TOOL],
                                           tool_choice={"type": "tool", "name": "nope"})
    except anthropic.BadRequestError as e:
        assert "not in tools" in e.body["error"]["message"]
    else:
        raise AssertionError("an unknown tool name was accepted")


async def test_speculate_false_reaches_the_engine(harness):
    await sdk(harness).messages.create(model="fake-model", max_tokens=8, messages=HI,
                                       extra_body={"speculate": False})
    assert harness.engine.added[-1].params.speculate is False

"""OpenAI API through the official `openai` SDK (async client) and raw HTTP, over fakes."""
from __future__ import annotations

import json

import openai
from frontend_fakes import EOS, FakeEngineClient

TOOL_REPLY = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' \
             '</tool_call>'
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HI = [{"role": "user", "content": "hi"}]


def sdk(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.base_url, api_key="none", max_retries=0)


async def sse_payloads(response) -> list[str]:
    text = await response.text()
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


# ---------------------------------------------------------------- chat
async def test_chat_non_streaming(harness):
    reply = await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, max_tokens=50)
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "Hello there, friend!"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len("<user>hi\n<assistant>")
    assert reply.usage.completion_tokens == len("Hello there, friend!")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    [msg] = harness.engine.added
    assert msg.params.max_tokens == 50 and msg.params.stop_token_ids == [EOS]


async def test_cached_tokens_zero_is_present_in_raw_json(harness):
    response = await harness.post("/v1/chat/completions", {"messages": HI})
    body = await response.json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_chat_streaming_with_usage_and_duplex_stats(make_harness):
    h = await make_harness(FakeEngineClient(num_cached=7, draft=(3, 2)))
    stream = await sdk(h).chat.completions.create(
        model="fake-model", messages=HI, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there, friend!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens_details.cached_tokens == 7
    assert usage.completion_tokens == len(text)
    extra = chunks[1].model_extra["duplex"]
    assert extra == {"draft_proposed": 3, "draft_accepted": 2}


async def test_stream_ends_with_done_and_no_usage_unless_asked(harness):
    response = await harness.post("/v1/chat/completions", {"messages": HI, "stream": True})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    payloads = await sse_payloads(response)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    assert all(json.loads(p)["usage"] is None for p in payloads[:-1])


async def test_n_choices_vary_seed_per_sample(harness):
    reply = await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, n=3, seed=11, max_tokens=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello" and c.finish_reason == "length"
               for c in reply.choices)
    assert sorted(m.params.seed for m in harness.engine.added) == [11, 12, 13]
    assert reply.usage.completion_tokens == 15
    assert reply.usage.prompt_tokens == len("<user>hi\n<assistant>")


async def test_n_choices_streaming(harness):
    stream = await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, n=2, stream=True)
    texts = {0: "", 1: ""}
    finishes = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: "Hello there, friend!", 1: "Hello there, friend!"}
    assert finishes == {0: "stop", 1: "stop"}


async def test_stop_string_is_cut_and_request_aborted(harness):
    reply = await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, stop=[" there", "zzz"])
    assert reply.choices[0].message.content == "Hello"
    assert reply.choices[0].finish_reason == "stop"
    assert harness.engine.aborted == [reply.id]


async def test_stop_string_streaming_never_leaks(harness):
    stream = await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, stop="friend", stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "Hello there, "


async def test_max_completion_tokens_wins_and_ends_with_length(harness):
    reply = await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, max_tokens=100, max_completion_tokens=4)
    assert reply.choices[0].message.content == "Hell"
    assert reply.choices[0].finish_reason == "length"


async def test_sampling_fields_and_extensions_reach_the_engine(harness):
    await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, temperature=0.5, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.25, seed=3,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True,
                    "retention": "agent", "cache_salt": "s1", "max_tokens": 8})
    [msg] = harness.engine.added
    p = msg.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 5, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert p.ignore_eos and p.stop_token_ids == []
    assert msg.retention == "agent" and msg.cache_salt == "s1"
    assert msg.deadline > msg.arrival_time > 0


async def test_content_parts_and_developer_role(harness):
    await sdk(harness).chat.completions.create(model="fake-model", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    messages = harness.recipe.chat_calls[-1]["messages"]
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1] == {"role": "user", "content": "a\nb"}
    assert messages[2]["tool_calls"][0]["function"]["name"] == "f"
    assert messages[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


async def test_logprobs(harness):
    reply = await sdk(harness).chat.completions.create(
        model="fake-model", messages=HI, max_tokens=3, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [t.token for t in content] == ["H", "e", "l"]
    assert all(t.logprob == -0.25 and len(t.top_logprobs) == 2 for t in content)
    assert content[0].bytes == [ord("H")]
    assert harness.engine.added[0].params.logprobs == 2


# ---------------------------------------------------------------- tools
async def test_tool_call_non_streaming(make_harness):
    h = await make_harness(FakeEngineClient(reply=TOOL_REPLY))
    reply = await sdk(h).chat.completions.create(model="fake-model", messages=HI,
                                                 tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."  # the blank before the call is not content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert h.recipe.chat_calls[-1]["tools"] == [WEATHER_TOOL]


async def test_tool_call_streaming(make_harness):
    h = await make_harness(FakeEngineClient(reply=TOOL_REPLY))
    stream = await sdk(h).chat.completions.create(model="fake-model", messages=HI,
                                                  tools=[WEATHER_TOOL], stream=True)
    name, args, finish = "", "", None
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name += call.function.name or ""
            args += call.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"}
    assert finish == "tool_calls"


async def test_tool_choice_none_disables_parsing(make_harness):
    h = await make_harness(FakeEngineClient(reply=TOOL_REPLY))
    reply = await sdk(h).chat.completions.create(model="fake-model", messages=HI,
                                                 tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content == TOOL_REPLY
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- completions
async def test_completion_string_prompt(harness):
    reply = await sdk(harness).completions.create(model="fake-model", prompt="Say hi")
    assert reply.object == "text_completion"
    assert reply.choices[0].text == "Hello there, fri"  # OpenAI's default max_tokens: 16
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len("Say hi")
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


async def test_completion_prompt_forms_and_n(harness):
    ids = harness.recipe.encode_prompt("abc")
    for prompt, num_prompts in (("abc", 1), (["abc", "de"], 2), (ids, 1), ([ids, ids[:1]], 2)):
        reply = await sdk(harness).completions.create(
            model="fake-model", prompt=prompt, n=2, max_tokens=2)
        assert [c.index for c in reply.choices] == list(range(2 * num_prompts))
        assert all(c.text == "He" for c in reply.choices)
        assert reply.usage.completion_tokens == 4 * num_prompts
    assert harness.engine.added[-1].prompt_token_ids == ids[:1]


async def test_completion_echo_and_logprobs(harness):
    reply = await sdk(harness).completions.create(
        model="fake-model", prompt="ab", echo=True, logprobs=1, max_tokens=2)
    choice = reply.choices[0]
    assert choice.text == "abHe"
    assert choice.logprobs.tokens == ["a", "b", "H", "e"]
    assert choice.logprobs.token_logprobs == [None, None, -0.25, -0.25]
    assert choice.logprobs.text_offset == [0, 1, 2, 3]
    assert choice.logprobs.top_logprobs[2] == {"H": -0.25}


async def test_completion_streaming(harness):
    stream = await sdk(harness).completions.create(
        model="fake-model", prompt="x", max_tokens=5, stream=True, echo=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "xHello"
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


# ---------------------------------------------------------------- models, tokenize
async def test_models(make_harness):
    h = await make_harness(served_model_names=("smol", "smol-alias"))
    models = await sdk(h).models.list()
    assert [m.id for m in models.data] == ["smol", "smol-alias"]
    assert models.data[0].object == "model"
    reply = await sdk(h).chat.completions.create(model="smol-alias", messages=HI)
    assert reply.model == "smol"


async def test_tokenize(harness):
    response = await harness.post("/tokenize", {"prompt": "abc"})
    assert await response.json() == {"tokens": harness.recipe.encode_prompt("abc"), "count": 3}
    response = await harness.post("/tokenize", {"messages": HI})
    body = await response.json()
    assert body["count"] == len("<user>hi\n<assistant>") == len(body["tokens"])
    response = await harness.post("/tokenize", {})
    assert response.status == 400


async def test_continue_final_message(harness):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
    done = await sdk(harness).chat.completions.create(
        model="fake-model", messages=messages, extra_body={"continue_final_message": True})
    assert harness.engine.added[-1].prompt_token_ids == \
        harness.recipe.encode_prompt("<user>hi\n<assistant>Sure:")
    assert done.choices[0].message.content == "Hello there, friend!"
    try:
        await sdk(harness).chat.completions.create(
            model="fake-model", messages=messages[:1],
            extra_body={"continue_final_message": True})
    except openai.BadRequestError as e:
        assert e.body["param"] == "messages" and "final assistant" in e.body["message"]
    else:
        raise AssertionError("nothing to continue, yet accepted")


CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
FORCED_ARGS = '{"city": "Oslo"}}\n</tool_call>'  # what the model writes after a forced header


async def test_named_tool_choice_forces_that_call(make_harness):
    h = await make_harness(FakeEngineClient(reply=FORCED_ARGS))
    reply = await sdk(h).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    forced = '<tool_call>\n{"name": "get_weather", "arguments": '
    prompt = h.engine.added[-1].prompt_token_ids
    assert prompt[-len(forced):] == h.recipe.encode_prompt(forced)  # the prompt opens the call
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert reply.usage.prompt_tokens == len(prompt)


async def test_required_tool_choice_lets_the_model_name_the_tool(make_harness):
    h = await make_harness(FakeEngineClient(reply='get_time", "arguments": {}}</tool_call>'))
    reply = await sdk(h).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "time?"}],
        tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice="required", stream=True)
    names = [call.function.name async for chunk in reply for call in
             (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
             if call.function and call.function.name]
    assert names == ["get_time"]
    forced = '<tool_call>\n{"name": "'
    assert h.engine.added[-1].prompt_token_ids[-len(forced):] == h.recipe.encode_prompt(forced)


async def test_forced_tool_choice_needs_a_tool_calling_template(make_harness):
    h = await make_harness()
    h.recipe.template = "{{ messages }}"  # no tool calling
    try:
        await sdk(h).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER_TOOL], tool_choice="required")
    except openai.BadRequestError as e:
        assert e.body["param"] == "tool_choice" and "no tool calling" in e.body["message"]
    else:
        raise AssertionError("a forced tool call was accepted without tool calling")
    assert not h.engine.added


async def test_speculate_false_reaches_the_engine(harness):
    await sdk(harness).chat.completions.create(model="fake-model", messages=HI,
                                               extra_body={"speculate": False})
    assert harness.engine.added[-1].params.speculate is False
    await sdk(harness).chat.completions.create(model="fake-model", messages=HI)
    assert harness.engine.added[-1].params.speculate is True

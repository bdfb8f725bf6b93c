"""What third-party clients hit with tool calls and stream shapes (issue 35 item 6), through the
official `openai` and `anthropic` SDKs against the real app, the model's output steered by a
script and held to the request's grammar (steered_support.py):

* a named / Anthropic `tool` choice is exactly one call, and required / `any` more only with
  parallel calls on: after the last allowed call the grammar leaves only end of output;
* a call cut by max_tokens is never a complete call and never markup in the text: a whole
  response leaves it out, a stream ends it with the length finish of its API, and every API
  says the same;
* Anthropic `output_config.format` (what `messages.parse(output_format=...)` sends) is the
  same grammar the OpenAI side uses; a bad schema is a 400 in Anthropic's shape;
* a truncated Responses stream ends with `response.incomplete`;
* the newline between parallel calls is not assistant text in any API.
"""
from __future__ import annotations

import json

import anthropic
import openai
import pydantic
import pytest
from steered_support import recipe_grammars, start_server, tools_recipe


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Current weather in a city"}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
                    "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# after a forced call's start (the prompt ends with `... "arguments": `): the call's rest,
# then the same call again and again, as a small model writes it
REPEATING = '{"city": "Paris"}}\n</tool_call>' + ("\n" + CALL) * 3
TWO_CALLS = '{"city": "Paris"}}\n</tool_call>\n' + CALL.replace("Paris", "Oslo")


class Weather(pydantic.BaseModel):
    city: str


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return tools_recipe(tmp_path_factory.mktemp("tools_recipe"))


@pytest.fixture(scope="module")
def grammars(recipe):
    grammars = recipe_grammars(recipe)
    yield grammars
    grammars.close()


class Clients:
    def __init__(self, engine, client) -> None:
        self.engine = engine
        url = str(client.make_url("")).rstrip("/")
        self.openai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        self.anthropic = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)


@pytest.fixture
async def serve(recipe, grammars):
    started: list = []

    async def make(script) -> Clients:
        text = script if callable(script) else (lambda prompt: script)
        return Clients(*await start_server(recipe, text, grammars, started))

    yield make
    for client in started:
        await client.close()


def _num_tokens(recipe, text: str) -> int:
    return len(recipe.encode_reply_start(text))


# ---------------------------------------------------------------- forced calls stop
async def test_a_named_choice_is_one_call_and_then_end_of_output(serve, recipe):
    """instructor's TOOLS mode: a named tool_choice with parallel_tool_calls left on."""
    clients = await serve(REPEATING)
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    reply = await clients.openai.chat.completions.parse(
        model="fake-model", messages=ASK, tools=[tool], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.parsed_arguments == Weather(city="Paris")
    # the grammar ended the output right after the call: nothing of the repeats was written
    assert reply.usage.completion_tokens == _num_tokens(recipe, '{"city": "Paris"}}\n</tool_call>')


async def test_required_allows_more_calls_only_with_parallel_calls_on(serve):
    clients = await serve(TWO_CALLS)
    reply = await clients.openai.chat.completions.create(
        model="fake-model", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200)
    assert [json.loads(c.function.arguments) for c in reply.choices[0].message.tool_calls] == \
        [{"city": "Paris"}, {"city": "Oslo"}]
    assert (reply.choices[0].finish_reason, reply.choices[0].message.content) == \
        ("tool_calls", None)
    reply = await clients.openai.chat.completions.create(
        model="fake-model", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in reply.choices[0].message.tool_calls] == \
        [{"city": "Paris"}]
    assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice, num_calls", [
    ({"type": "tool", "name": "get_weather"}, 1),
    ({"type": "any", "disable_parallel_tool_use": True}, 1),
    ({"type": "any"}, 2),
])
async def test_anthropic_tool_and_any(serve, choice, num_calls):
    clients = await serve(TWO_CALLS)
    message = await clients.anthropic.messages.create(
        model="fake-model", max_tokens=200, tools=ANTHROPIC_TOOLS, tool_choice=choice, messages=ASK)
    assert [(b.type, b.input) for b in message.content] == \
        [("tool_use", {"city": "Paris"}), ("tool_use", {"city": "Oslo"})][:num_calls]
    assert message.stop_reason == "tool_use"


async def test_anthropic_any_cut_in_a_repeated_call_returns_only_whole_calls(serve, recipe):
    """`any` with parallel calls on lets a small model repeat its call; max_tokens cuts the
    repeat: the whole message holds the whole call only (no trailing `input: {}`)."""
    max_tokens, written = _cut(recipe, REPEATING, '</tool_call>\n<tool_call>\n{"name": '
                               '"get_weather", "arguments": {"city": "Pa')
    clients = await serve(REPEATING)
    message = await clients.anthropic.messages.create(
        model="fake-model", max_tokens=max_tokens, tools=ANTHROPIC_TOOLS, messages=ASK,
        tool_choice={"type": "any"})
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Paris"})]
    assert message.stop_reason == "max_tokens"
    blocks, stop_reason = await _anthropic_stream(clients, max_tokens=max_tokens,
                                                  tool_choice={"type": "any"})
    assert blocks == [("tool_use", '{"city": "Paris"}'),
                      ("tool_use", written.rsplit('"arguments": ', 1)[1])]
    assert stop_reason == "max_tokens"

# ---------------------------------------------------------------- a call cut by max_tokens
def _cut(recipe, text: str, marker: str) -> tuple[int, str]:
    """(max_tokens that cut `text` just after `marker` is written, the text written)."""
    ids = recipe.encode_reply_start(text)
    k = next(k for k in range(len(ids) + 1) if marker in recipe.decode(ids[:k]))
    return k, recipe.decode(ids[:k])


def _cut_arguments(recipe) -> tuple[int, str]:
    """(max_tokens that cut CALL inside the city's name, the arguments written by then)."""
    max_tokens, written = _cut(recipe, CALL, '"Pa')
    arguments = written.split('"arguments": ')[1]
    assert '{"city": "Paris"}'.startswith(arguments) and len(arguments) < 17
    return max_tokens, arguments


async def _openai_stream(clients, **kwargs) -> tuple[str, dict, str]:
    """(content, {index: [name, arguments]}, finish_reason) of a streamed chat completion."""
    stream = await clients.openai.chat.completions.create(
        model="fake-model", messages=ASK, tools=TOOLS, stream=True, **kwargs)
    content, calls, finish = [], {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
    return "".join(content), calls, finish


async def _anthropic_stream(clients, **kwargs) -> tuple[list, str]:
    """([(block type, text or input JSON as streamed)], stop_reason) of a streamed message."""
    stream = await clients.anthropic.messages.create(
        model="fake-model", messages=ASK, tools=ANTHROPIC_TOOLS, stream=True, **kwargs)
    blocks, stop_reason = [], None
    async for event in stream:
        if event.type == "content_block_start":
            blocks.append([event.content_block.type, ""])
        elif event.type == "content_block_delta":
            delta = event.delta
            blocks[event.index][1] += delta.text if delta.type == "text_delta" \
                else delta.partial_json
        elif event.type == "message_delta":
            stop_reason = event.delta.stop_reason
    return [tuple(b) for b in blocks], stop_reason


async def _responses_stream(clients, **kwargs) -> list:
    stream = await clients.openai.responses.create(
        model="fake-model", input="Weather in Paris?", tools=RESPONSES_TOOLS, stream=True,
        **kwargs)
    return [event async for event in stream]


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER,
                    "description": "Current weather in a city"}]


async def test_a_call_cut_mid_arguments_in_openai_chat(serve, recipe):
    max_tokens, arguments = _cut_arguments(recipe)
    clients = await serve(CALL)
    reply = await clients.openai.chat.completions.create(
        model="fake-model", messages=ASK, tools=TOOLS, max_tokens=max_tokens)
    message = reply.choices[0].message
    assert (reply.choices[0].finish_reason, message.content, message.tool_calls) == \
        ("length", "", None)
    assert await _openai_stream(clients, max_tokens=max_tokens) == \
        ("", {0: ["get_weather", arguments]}, "length")


async def test_a_call_cut_mid_arguments_in_anthropic(serve, recipe):
    max_tokens, arguments = _cut_arguments(recipe)
    clients = await serve(CALL)
    message = await clients.anthropic.messages.create(
        model="fake-model", messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=max_tokens)
    assert [(b.type, b.text) for b in message.content] == [("text", "")]
    assert message.stop_reason == "max_tokens"
    assert await _anthropic_stream(clients, max_tokens=max_tokens) == \
        ([("tool_use", arguments)], "max_tokens")


async def test_a_call_cut_mid_arguments_in_responses(serve, recipe):
    max_tokens, arguments = _cut_arguments(recipe)
    clients = await serve(CALL)
    response = await clients.openai.responses.create(
        model="fake-model", input="Weather in Paris?", tools=RESPONSES_TOOLS,
        max_output_tokens=max_tokens)
    assert (response.status, response.incomplete_details.reason) == \
        ("incomplete", "max_output_tokens")
    assert [(item.type, item.status, item.content[0].text) for item in response.output] == \
        [("message", "incomplete", "")]
    events = await _responses_stream(clients, max_output_tokens=max_tokens)
    assert events[-1].type == "response.incomplete"
    assert not [e for e in events if e.type == "response.output_text.delta"]
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.type, done.status, done.arguments) == \
        ("function_call", "incomplete", arguments)
    assert [(i.type, i.status) for i in events[-1].response.output] == \
        [("function_call", "incomplete")]


async def test_a_call_whose_closing_tag_alone_was_cut_is_whole_in_every_api(serve, recipe):
    max_tokens, written = _cut(recipe, CALL, "</tool")
    assert written.endswith("</tool") and written != CALL
    clients = await serve(CALL)
    reply = await clients.openai.chat.completions.create(
        model="fake-model", messages=ASK, tools=TOOLS, max_tokens=max_tokens)
    [call] = reply.choices[0].message.tool_calls
    assert (reply.choices[0].finish_reason, call.function.arguments) == \
        ("length", '{"city": "Paris"}')
    message = await clients.anthropic.messages.create(
        model="fake-model", messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=max_tokens)
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Paris"})]
    assert message.stop_reason == "max_tokens"
    response = await clients.openai.responses.create(
        model="fake-model", input="Weather in Paris?", tools=RESPONSES_TOOLS,
        max_output_tokens=max_tokens)
    assert response.status == "incomplete"
    assert [(i.type, i.status, i.arguments) for i in response.output] == \
        [("function_call", "completed", '{"city": "Paris"}')]


async def test_a_truncated_responses_stream_ends_incomplete(serve):
    clients = await serve("Hello there, my good friend.")
    events = await _responses_stream(clients, max_output_tokens=3)
    assert isinstance(events[-1], openai.types.responses.ResponseIncompleteEvent)
    assert not [e for e in events if e.type == "response.completed"]
    response = events[-1].response
    assert (response.status, response.incomplete_details.reason) == \
        ("incomplete", "max_output_tokens")
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.type, done.status) == ("message", "incomplete")
    assert [(i.type, i.status) for i in response.output] == [("message", "incomplete")]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.content[0].text == text and text


# ---------------------------------------------------------------- blanks between calls
PARALLEL = "\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n"


async def test_no_blank_text_beside_parallel_calls(serve):
    clients = await serve(PARALLEL)
    reply = await clients.openai.chat.completions.create(
        model="fake-model", messages=ASK, tools=TOOLS, max_tokens=200)
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in message.tool_calls] == \
        ['{"city": "Paris"}', '{"city": "Oslo"}']
    content, calls, _ = await _openai_stream(clients, max_tokens=200)
    assert (content, len(calls)) == ("", 2)
    message = await clients.anthropic.messages.create(
        model="fake-model", messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=200)
    assert [b.type for b in message.content] == ["tool_use", "tool_use"]
    blocks, stop_reason = await _anthropic_stream(clients, max_tokens=200)
    assert ([b[0] for b in blocks], stop_reason) == (["tool_use", "tool_use"], "tool_use")
    response = await clients.openai.responses.create(
        model="fake-model", input="Weather in Paris?", tools=RESPONSES_TOOLS)
    assert [i.type for i in response.output] == ["function_call", "function_call"]
    events = await _responses_stream(clients)
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == \
        ["function_call", "function_call"]
    assert events[-1].type == "response.completed"


# ---------------------------------------------------------------- Anthropic structured output
async def test_anthropic_output_format_is_the_openai_grammar(serve):
    clients = await serve('{"city": "Paris"}')
    message = await clients.anthropic.messages.parse(
        model="fake-model", max_tokens=100, messages=ASK, output_format=Weather)
    assert message.parsed_output == Weather(city="Paris")
    sent = clients.engine.added[-1].params.constraint
    await clients.openai.chat.completions.create(
        model="fake-model", messages=ASK, max_tokens=100, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": json.loads(sent.spec)}})
    assert clients.engine.added[-1].params.constraint == sent
    assert sent.kind == "json_schema"
    assert json.loads(sent.spec)["properties"] == {"city": {"title": "City", "type": "string"}}


async def test_anthropic_output_format_holds_the_model_to_the_schema(serve):
    """A model that would go on in prose after the object is ended where the schema's value
    ends."""
    clients = await serve('{"city": "Paris"} and more')
    message = await clients.anthropic.messages.create(
        model="fake-model", max_tokens=100, messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert [(b.type, b.text) for b in message.content] == [("text", '{"city": "Paris"}')]
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("output_config, param", [
    ({"format": {"type": "json_schema", "schema": {"type": "nope"}}},
     "output_config.format.schema"),
    ({"format": {"type": "json_schema", "schema": "{not json"}}, "output_config.format.schema"),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
    ({"format": {"type": "regex", "schema": WEATHER}}, "output_config.format.type"),
])
async def test_a_bad_anthropic_output_format_is_a_400_in_anthropic_shape(serve, output_config,
                                                                        param):
    clients = await serve("{}")
    with pytest.raises(anthropic.BadRequestError) as e:
        await clients.anthropic.messages.create(model="fake-model", max_tokens=10, messages=ASK,
                                                output_config=output_config)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert param in e.value.body["error"]["message"]
    assert clients.engine.added == []


async def test_anthropic_output_format_and_a_forced_tool_contradict(serve):
    clients = await serve("{}")
    with pytest.raises(anthropic.BadRequestError) as e:
        await clients.anthropic.messages.create(
            model="fake-model", max_tokens=10, messages=ASK, tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any"},
            output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert "output_config.format.schema" in e.value.body["error"]["message"]

"""llama3_json and mistral calls cut by max_tokens, through the official `openai` and
`anthropic` SDKs against a local server whose model is steered by a script and held to the
request's grammar (steered_support.py): as with Hermes, a cut call is never text with markup;
a whole response leaves it out, a stream ends it with the length finish; whole calls before
it are kept."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest
from steered_support import recipe_grammars, start_server, tools_recipe

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = {"llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                        '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
         # each call its own array, as the format's grammar writes parallel calls
         "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
                     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return tools_recipe(tmp_path_factory.mktemp("tools_recipe"))


@pytest.fixture(scope="module")
def grammars(recipe):
    grammars = recipe_grammars(recipe)
    yield grammars
    grammars.close()


@pytest.fixture
async def serve(recipe, grammars):
    started: list = []

    async def make(parser: str):
        _, client = await start_server(recipe, lambda prompt: CALLS[parser], grammars,
                                       started, tool_call_parser=parser)
        url = str(client.make_url("")).rstrip("/")
        return (openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
                anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0))

    yield make
    for client in started:
        await client.close()


def cut_in_paris(recipe, parser: str) -> tuple[int, str]:
    """(max_tokens that cut the second call inside "Paris", its arguments written by then)."""
    ids = recipe.encode_reply_start(CALLS[parser])
    for k in range(len(ids)):
        written = recipe.decode(ids[:k])
        arguments = written[written.rfind('{"city"'):]
        if "Paris" in written and '{"city": "P' in arguments and \
                '{"city": "Paris"'.startswith(arguments) and arguments != '{"city": "Paris"':
            return k, arguments
    raise AssertionError("no token ends inside Paris")


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
async def test_a_cut_call_is_left_out_of_a_whole_response(serve, recipe, parser):
    max_tokens, _ = cut_in_paris(recipe, parser)
    sdk, claude = await serve(parser)
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                              max_tokens=max_tokens)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("length", None)
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_weather", {"city": "Oslo"})]
    message = await claude.messages.create(model="fake-model", messages=ASK,
                                           tools=ANTHROPIC_TOOLS, max_tokens=max_tokens)
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Oslo"})]
    assert message.stop_reason == "max_tokens"


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
async def test_a_cut_call_streams_as_a_call_then_length(serve, recipe, parser):
    max_tokens, arguments = cut_in_paris(recipe, parser)
    sdk, _ = await serve(parser)
    stream = await sdk.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                               max_tokens=max_tokens, stream=True)
    content, calls, finish = [], {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
    assert ("".join(content), finish) == ("", "length")
    assert calls == {0: ["get_weather", '{"city": "Oslo"}'], 1: ["get_weather", arguments]}

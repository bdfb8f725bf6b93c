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

from duplex.engine.sampling_params import Constraint

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

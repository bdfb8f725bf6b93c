"""Structured output and tool calls through the official SDKs behind the real app: on a
tiny random model (its text is noise, so only the constraint can make it valid) and on the
default model (SmolLM2-135M): every output parses and validates; bad constraints are 400s
in the API's own shape, naming the field."""
from __future__ import annotations

import enum
import json
import re
from typing import Optional

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from duplex.engine.text.recipe import Recipe
from duplex.frontend.serve import TOOLS_TEMPLATE
from tests.structured.conftest import make_core
from tests.structured.support import ApiServer, CoreEngine

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Current weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                           "description": "Current time in a timezone"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# strings bounded, so a random model must close its call within max_tokens
BOUNDED = [{"type": "function", "function": {
    **t["function"], "parameters": {**t["function"]["parameters"], "properties": {
        k: {**v, "maxLength": 8} if v.get("type") == "string" else v
        for k, v in t["function"]["parameters"]["properties"].items()}}}} for t in TOOLS]


def _serve(model: str | None) -> ApiServer:
    core = make_core(model, weights_dtype="float32")
    return ApiServer(CoreEngine(core), Recipe.from_model(core.model_path),
                     chat_template=TOOLS_TEMPLATE.read_text(), served_model_names=("x",))


@pytest.fixture(scope="module")
def server(tiny_model):
    api = _serve(tiny_model)
    yield api
    api.close()


@pytest.fixture(scope="module")
def default_server():
    api = _serve(None)
    yield api
    api.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return _client(server)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: Optional[str] = pydantic.Field(max_length=20)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int
    favorite: Color
    hobbies: list[str] = pydantic.Field(max_length=3)
    home: Address


def _parse_person(client: openai.OpenAI, **kw) -> Person:
    completion = client.chat.completions.parse(
        model="x", messages=_ask("Invent a person and give their details."),
        response_format=Person, max_tokens=300, **kw)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.home, Address)
    assert person.favorite in Color
    assert completion.choices[0].finish_reason == "stop"
    return person


def test_parse_returns_a_valid_nested_pydantic_object(oai):
    _parse_person(oai, temperature=0)
    _parse_person(oai, temperature=1.0, seed=3)


def test_on_the_default_model_parse_and_a_required_tool_call_are_valid(default_server):
    client = _client(default_server)
    _parse_person(client, temperature=0)
    reply = client.chat.completions.create(
        model="x", messages=_ask("What's the weather in Paris right now?"), tools=TOOLS,
        tool_choice="required", temperature=0, max_tokens=200)
    _check_calls(reply.choices[0].message.tool_calls, SCHEMAS)


def test_json_object_regex_choice_and_structured_outputs(oai):
    reply = oai.chat.completions.create(
        model="x", messages=_ask("Describe the sky as JSON."), temperature=0, max_tokens=200,
        response_format={"type": "json_object"}, logit_bias={"28": -100})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = oai.chat.completions.create(
        model="x", messages=_ask("Give a date."), temperature=0, max_tokens=20,
        extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]",
                        reply.choices[0].message.content)
    reply = oai.chat.completions.create(
        model="x", messages=_ask("Is the sky green?"), temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert reply.choices[0].message.content in ("yes", "no", "maybe")
    completion = oai.completions.create(
        model="x", prompt="The answer is", max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["left", "right"]})
    assert completion.choices[0].text in ("left", "right")


def test_streamed_structured_output_validates(oai):
    schema = Person.model_json_schema()
    stream = oai.chat.completions.create(
        model="x", messages=_ask("Invent a person."), temperature=0, max_tokens=300,
        stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Person.model_validate_json(text)


def _check_calls(calls, names) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_named_and_auto_give_valid_calls(oai):
    question = _ask("What's the weather in Paris right now?")
    reply = oai.chat.completions.create(model="x", messages=question, tools=BOUNDED,
                                        tool_choice="required", temperature=0, max_tokens=200,
                                        parallel_tool_calls=False)
    assert reply.choices[0].finish_reason == "tool_calls"
    _check_calls(reply.choices[0].message.tool_calls, SCHEMAS)
    assert len(reply.choices[0].message.tool_calls) == 1
    reply = oai.chat.completions.create(
        model="x", messages=question, tools=BOUNDED, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    _check_calls(reply.choices[0].message.tool_calls, ["get_time"])
    stream = oai.chat.completions.create(model="x", messages=question, tools=BOUNDED,
                                         tool_choice="auto", temperature=0, max_tokens=200,
                                         stream=True)
    calls: dict[int, dict] = {}
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    for call in calls.values():  # auto: the model may answer in text; a call must be valid
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_anthropic_tool_choice_any_and_tool(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in BOUNDED]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = client.messages.create(model="x", max_tokens=200, tools=tools,
                                     tool_choice=choice, messages=_ask("Weather in Oslo?"))
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and msg.stop_reason == "tool_use"
        for block in uses:
            assert block.id.startswith("toolu_")
            jsonschema.validate(block.input, SCHEMAS[block.name])
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=2000, messages=_ask("hi"),
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in str(e.value)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": json.loads('{"items":' * 80 + '{}' + '}' * 80)}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
     "response_format"),
    ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens"),
    ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
])
def test_bad_constraints_are_400s_naming_the_field(oai, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="x", messages=_ask("hi"), max_tokens=4,
                                    extra_body=body)
    assert e.value.body["param"] == param, e.value.body

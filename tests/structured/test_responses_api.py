"""The Responses API and /v1/models/{id} through the official openai SDK, on the tiny
random model: plain, streamed, previous_response_id (a prefix-cache hit), a JSON schema
through text.format, a required function call; bad input is a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from duplex.engine.text.recipe import Recipe
from duplex.frontend.serve import TOOLS_TEMPLATE
from tests.structured.conftest import make_core
from tests.structured.support import ApiServer, CoreEngine
from tests.structured.test_grammar_engine import SCHEMA
from tests.structured.test_tool_formats import BOUNDED, SCHEMAS


@pytest.fixture(scope="module")
def client(tiny_model):
    api = ApiServer(CoreEngine(make_core(tiny_model, weights_dtype="float32")),
                    Recipe.from_model(tiny_model), served_model_names=("x",),
                    chat_template=TOOLS_TEMPLATE.read_text())
    yield openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    api.close()


def test_models_by_id(client):
    assert client.models.retrieve("x").id == "x"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_create_stream_and_continue_with_previous_response_id(client):
    first = client.responses.create(model="x", input="Describe an animal.", max_output_tokens=12,
                                    temperature=0)
    assert first.id.startswith("resp_") and first.output[0].type == "message"
    text = first.output_text
    assert first.usage.output_tokens == 12 and first.status == "incomplete"
    events = list(client.responses.create(model="x", input="Describe an animal.",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    second = client.responses.create(model="x", input="And another?", max_output_tokens=4,
                                     previous_response_id=first.id, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the earlier turn, from KV
    assert client.responses.retrieve(second.id).id == second.id


def test_json_schema_and_a_required_function_call(client):
    reply = client.responses.create(
        model="x", input="An animal as JSON.", max_output_tokens=150, temperature=0,
        text={"format": {"type": "json_schema", "name": "animal", "schema": SCHEMA,
                         "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    tools = [{"type": "function", **t["function"]} for t in BOUNDED]
    for stream in (False, True):
        request = dict(model="x", input="Weather?", tools=tools, tool_choice="required",
                       max_output_tokens=150, temperature=0)
        if stream:
            done = [e for e in client.responses.create(**request, stream=True)
                    if e.type == "response.completed"]
            calls = [o for o in done[0].response.output if o.type == "function_call"]
        else:
            calls = [o for o in client.responses.create(**request).output
                     if o.type == "function_call"]
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nope"}}}}, "text.format"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "background": True}, "background"),
])
def test_bad_requests_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", **body)
    assert e.value.body["param"] == param

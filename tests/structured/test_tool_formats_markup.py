"""deepseek_v3 and qwen3_coder constrained: the tool_choice grammar (frontend/structured.py
over the formats' tags) accepts a call as the model's template writes it and refuses
arguments off the schema; on a tiny random model a required call comes back valid through
the official SDK, the same streamed and not."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from duplex.engine.text.recipe import Recipe
from duplex.engine.text.tool_formats import TOOL_FORMATS
from duplex.frontend import structured
from duplex.frontend.serve import TOOLS_TEMPLATE
from tests.structured.conftest import make_core
from tests.structured.support import ApiServer, CoreEngine

# values a random model can only write validly in a typed form (no free strings, which a
# parser without the schema could read as numbers)
SETTINGS = {"type": "object", "properties": {
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}, "metric": {"type": "boolean"}},
    "required": ["unit", "days", "metric"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_units", "parameters": SETTINGS}}]

CALLS = {
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>set_units\n"
                    '```json\n{"unit": "celsius", "days": 3, "metric": true}\n```'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "qwen3_coder": ("<tool_call>\n<function=set_units>\n<parameter=unit>\ncelsius\n</parameter>"
                    "\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>"
                    "\n</function>\n</tool_call>"),
}
OFF_SCHEMA = {"deepseek_v3": ('"days": 3', '"days": 30'),
              "qwen3_coder": ("\n3\n", "\n30\n")}


def grammar(name: str, choice: str, parallel: bool) -> xgrammar.Grammar:
    requested = structured.for_chat(None, TOOLS, TOOL_FORMATS[name], choice, parallel)
    return xgrammar.Grammar.from_structural_tag(requested.constraint.spec)


@pytest.mark.parametrize("name", list(CALLS))
def test_the_grammar_takes_the_templates_calls(name):
    call = CALLS[name]
    required = grammar(name, "required", parallel=True)
    assert _is_grammar_accept_string(required, call)
    assert _is_grammar_accept_string(required, call + "\n" + call)
    assert not _is_grammar_accept_string(required, "Sure. " + call)
    assert not _is_grammar_accept_string(required, call.replace(*OFF_SCHEMA[name]))
    assert not _is_grammar_accept_string(grammar(name, "required", parallel=False),
                                         call + "\n" + call)
    auto = grammar(name, "auto", parallel=True)
    assert _is_grammar_accept_string(auto, "Sure. " + call)
    assert _is_grammar_accept_string(auto, "No call.")


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = CoreEngine(make_core(tiny_model, weights_dtype="float32"))
    yield engine
    engine.close_now()


@pytest.mark.parametrize("name", list(CALLS))
def test_a_required_call_is_valid(engine, tiny_model, name):
    api = ApiServer(engine, Recipe.from_model(tiny_model), served_model_names=("x",),
                    chat_template=TOOLS_TEMPLATE.read_text(), tool_call_parser=name)
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    request = dict(model="x", messages=[{"role": "user", "content": "units?"}], tools=TOOLS,
                   tool_choice="required", max_tokens=200, temperature=0,
                   parallel_tool_calls=False)
    try:
        reply = client.chat.completions.create(**request)
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in reply.choices[0].message.tool_calls]
        assert calls and reply.choices[0].finish_reason == "tool_calls"
        for call_name, arguments in calls:
            assert call_name == "set_units"
            jsonschema.validate(arguments, SETTINGS)
        streamed: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(**request, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = streamed.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
        assert calls == [(n, json.loads(a)) for n, a in streamed.values()]
    finally:
        api.close_app()

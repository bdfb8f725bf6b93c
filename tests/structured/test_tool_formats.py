"""`--tool-call-parser` formats: each parses its calls the same however the text is split,
plain text stays text, and (except pythonic) a required call constrained on a tiny random
model comes back as a valid call through the official SDK, streamed and not."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from duplex.engine.text.recipe import Recipe
from duplex.frontend.serve import TOOLS_TEMPLATE
from duplex.engine.text.tool_formats import TOOL_FORMATS
from duplex.engine.text.tool_parser import TextDelta, ToolCallArgsDelta, ToolCallStart
from tests.structured.conftest import make_core
from tests.structured.support import ApiServer, CoreEngine
from tests.structured.test_structured_api import BOUNDED, SCHEMAS

SAMPLES = {
    "hermes": ('Sure.<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n'
               '</tool_call>'),
    "llama3_json": ('{"name": "get_time", "parameters": {"timezone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'),
    "mistral": ('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'),
    "pythonic": '[get_time(timezone="UTC"), get_weather(city="Oslo", unit="celsius")]',
}


def _parse(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser = TOOL_FORMATS[name].new_parser()
    events = [e for p in pieces for e in parser.push(p)] + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    args = {i: "" for i in names}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            args[e.index] += e.json_text
    return text, [(names[i], json.loads(args[i])) for i in sorted(names)]


@pytest.mark.parametrize("name", list(SAMPLES))
def test_every_split_parses_the_same_calls(name):
    sample = SAMPLES[name]
    whole = _parse(name, [sample])
    assert ("get_time", {"timezone": "UTC"}) in whole[1]
    assert whole[0] in ("", "Sure.")
    for cut in range(1, len(sample)):
        assert _parse(name, [sample[:cut], sample[cut:]]) == whole, cut
    assert _parse(name, ["Just text, [no] {calls} here."]) == \
        ("Just text, [no] {calls} here.", [])


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = CoreEngine(make_core(tiny_model, weights_dtype="float32"))
    yield engine
    engine.close_now()


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_a_required_call_is_valid_in_each_constrained_format(engine, tiny_model, name):
    api = ApiServer(engine, Recipe.from_model(tiny_model), served_model_names=("x",),
                    chat_template=TOOLS_TEMPLATE.read_text(), tool_call_parser=name)
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
    request = dict(model="x", messages=[{"role": "user", "content": "time?"}], tools=BOUNDED,
                   tool_choice="required", max_tokens=200, temperature=0)
    try:
        if not TOOL_FORMATS[name].can_constrain:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(**request)
            assert e.value.body["param"] == "tool_choice"
            return
        calls = client.chat.completions.create(**request).choices[0].message.tool_calls
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            assert "\t" not in call.function.arguments
        streamed: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(**request, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = streamed.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [(n, json.loads(a)) for n, a in streamed.values()]
    finally:
        api.close_app()


def _events(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(text, [(name, arguments as written)]): cut calls' arguments need not be JSON."""
    parser = TOOL_FORMATS[name].new_parser()
    events = [e for p in pieces for e in parser.push(p)] + parser.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index][1] += e.json_text
    return "".join(e.text for e in events if isinstance(e, TextDelta)), \
        [tuple(c) for c in calls.values()]


TIME, OSLO = ("get_time", '{"timezone": "UTC"}'), \
    ("get_weather", '{"city": "Oslo", "unit": "celsius"}')
CUT_CASES = {
    "llama3_json": [
        ('{"name": "get_time", "parameters": {"timezone": "UTC"}}; {"name": "get_weather", '
         '"parameters": {"city": "Os', ("", [TIME, ("get_weather", '{"city": "Os')])),
        ('{"name": "get_time", "parameters": {"timezone": "UTC"}}; {"name": "get_wea',
         ("", [TIME])),
        ('{"name": "get_time", "parameters": {"timezone": "UTC"}', ("", [TIME])),
        ('Hi. {"name": "get_time", "param', ("Hi. ", [])),
        ('<|python_tag|>', ("", [])),
        ('A {"name" is a key}', ('A {"name" is a key}', [])),
    ],
    "mistral": [
        ('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}}, '
         '{"name": "get_weather", "arguments": {"city": "Os',
         ("Sure.", [TIME, ("get_weather", '{"city": "Os')])),
        ('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}}, {"na',
         ("Sure.", [TIME])),
        ('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}}',
         ("Sure.", [TIME])),
        ("Sure.[TOOL_CALLS][", ("Sure.", [])),
        ("Sure.[TOOL_CALLS] is a token", ("Sure.[TOOL_CALLS] is a token", [])),
    ],
}


@pytest.mark.parametrize("name,case", [(n, c) for n, cases in CUT_CASES.items()
                                       for c in cases])
def test_a_cut_call_is_never_text_with_markup(name, case):
    text, expected = case
    assert _events(name, [text]) == expected
    for cut in range(len(text) + 1):
        assert _events(name, [text[:cut], text[cut:]]) == expected


@pytest.mark.parametrize("name", ["llama3_json", "mistral"])
def test_every_cut_of_a_sample_keeps_whole_calls_and_no_markup(name):
    """From its whole start marker on (a partial marker at the end stays text, as Hermes' does)."""
    sample = SAMPLES[name]
    marker = '{"name"' if name == "llama3_json" else "[TOOL_CALLS]"
    start = sample.find(marker)
    whole = [TIME, OSLO]
    for cut in range(start + len(marker), len(sample) + 1):
        text, calls = _events(name, [sample[:cut]])
        assert text == sample[:start], cut
        for written, expected in zip(calls, whole):  # all but a cut last one are whole
            assert written == expected or (written is calls[-1] and written[0] == expected[0]
                                           and expected[1].startswith(written[1])), cut

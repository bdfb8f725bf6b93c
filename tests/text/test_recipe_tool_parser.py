"""Hermes-style tool calls: streaming at any split gives the one-shot answer; garbage is text;
a call cut short is never text with markup; blanks beside calls are not content."""
import itertools
import json

import pytest

from duplex.engine.text.tool_parser import (TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallParser,
                                  ToolCallStart, is_whole_json, parse_tool_calls,
                                  tools_supported)
from recipe_factories import TOOLS_TEMPLATE


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(name, arguments, index=0):
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def one_shot(text):
    return parse_tool_calls(text, id_factory=ids())


def streamed(deltas):
    """Aggregate the events of a streaming parse into (content, calls); check their order."""
    parser = ToolCallParser(id_factory=ids())
    events = [event for delta in deltas for event in parser.push(delta)] + parser.finish()
    content, calls, open_index = [], [], None
    for event in events:
        if isinstance(event, TextDelta):
            assert event.text and open_index is None
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            assert open_index is None and event.index == len(calls)
            open_index = event.index
            calls.append({"id": event.id, "type": "function",
                          "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index == open_index and event.json_text
            calls[event.index]["function"]["arguments"] += event.json_text
        else:
            assert isinstance(event, ToolCallEnd) and event.index == open_index
            open_index = None
    assert open_index is None
    return "".join(content), calls


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n</tool_call>'

CASES = {
    "one call": (WEATHER, ("", [call("get_weather",
                                     '{"city": "Paris", "n": [1, {"a": "}"}]}')])),
    "text around calls": (
        'Let me check.\n' + WEATHER + '\n<tool_call>\n{"name": "search", "arguments": {}}\n'
        '</tool_call> done',
        ("Let me check. done",
         [call("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'),
          call("search", "{}", 1)])),
    "unicode and escapes": (
        '<tool_call>{"name": "say\\u00e9", "arguments": {"text": "你好 \\"🙂\\" \\\\ </tool"}}'
        '</tool_call>',
        ("", [call("sayé", '{"text": "你好 \\"🙂\\" \\\\ </tool"}')])),
    "arguments first": (
        '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>',
        ("", [call("search", '{"q": "x"}')])),
    "no arguments key": ('<tool_call>{"name": "now"}</tool_call>', ("", [call("now", "{}")])),
    "garbled": ("a<tool_call>not json</tool_call>b",
                ("a<tool_call>not json</tool_call>b", [])),
    "json but not a call": ('<tool_call>{"tool": 1}</tool_call>',
                            ('<tool_call>{"tool": 1}</tool_call>', [])),
    "unterminated before commit": ('hi <tool_call>{"na', ("hi", [])),
    "unterminated tag before prose": ("a <tool_call> is a tag", ("a <tool_call> is a tag", [])),
    "cut in the closing tag": ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call',
                               ("", [call("f", '{"a": 1}')])),
    "cut after the closing tag's first character": (
        '<tool_call>\n{"name": "f", "arguments": {"a": "x"}}\n<', ("", [call("f", '{"a": "x"}')])),
    "cut before the arguments": ('Sure.\n<tool_call>\n{"name": "f", "arguments": ',
                                 ("Sure.", [])),
    "blanks between and after calls": (
        '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n \n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>\n',
        ("", [call("f", "{}"), call("g", "{}", 1)])),
    "blank text without calls": ("Hi.\n\n", ("Hi.\n\n", [])),
    "unterminated after commit": ('<tool_call>{"name": "f", "arguments": {"a": [1, 2',
                                  ("", [call("f", '{"a": [1, 2')])),
    "missing outer brace": ('<tool_call>{"name": "f", "arguments": {"a": 1}\n</tool_call>',
                            ("", [call("f", '{"a": 1}')])),
    "string arguments": ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
                         ("", [call("f", '"{\\"a\\": 1}"')])),
    "trailing garbage after arguments": (
        '<tool_call>{"name": "f", "arguments": {"a": 1} x}</tool_call>',
        ("", [call("f", '{"a": 1} x')])),
    "partial open tag at end": ("text <tool_ca", ("text <tool_ca", [])),
    "lookalike tag": ("<tool_calls> and <tool_call", ("<tool_calls> and <tool_call", [])),
    "plain text": ("just words, {braces} and </tool_call>",
                   ("just words, {braces} and </tool_call>", [])),
    "empty": ("", ("", [])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_shot(name):
    text, expected = CASES[name]
    assert one_shot(text) == expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_point_and_char_by_char(name):
    text, expected = CASES[name]
    assert streamed(list(text)) == expected
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]]) == expected
    for cut in range(0, len(text) + 1, 7):   # three pieces
        for cut2 in range(cut, len(text) + 1, 5):
            assert streamed([text[:cut], text[cut:cut2], text[cut2:]]) == expected


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(id_factory=ids())
    events = parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert events == [ToolCallStart(0, "call_0", "get_weather"),
                      ToolCallArgsDelta(0, '{"city": "Pa')]
    assert parser.push('ris"}') == [ToolCallArgsDelta(0, 'ris"')]   # `}` may be the outer one
    assert parser.push("}\n</tool_call>") == [ToolCallArgsDelta(0, "}"), ToolCallEnd(0)]
    assert parser.finish() == []


def test_a_cut_call_has_no_markup_and_is_not_whole():
    _, calls = one_shot('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert calls == [call("f", '{"city": "Par')]
    assert not is_whole_json(calls[0]["function"]["arguments"])
    _, calls = one_shot('<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_c')
    assert calls == [call("f", '{"city": "Paris"}')]
    assert is_whole_json(calls[0]["function"]["arguments"])


def test_arguments_are_valid_json_text():
    _, calls = one_shot(CASES["text around calls"][0])
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "n": [1, {"a": "}"}]}, {}]


def test_ids_are_unique_by_default():
    _, calls = parse_tool_calls(WEATHER + WEATHER)
    assert len({c["id"] for c in calls}) == 2 and calls[0]["id"].startswith("call_")


def test_tools_supported():
    assert tools_supported(TOOLS_TEMPLATE)
    assert not tools_supported("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not tools_supported("{{ tools | tojson }}")   # tools, but no <tool_call> format
    assert not tools_supported(None)


def test_default_model_template_has_no_tools(default_recipe):
    assert not tools_supported(default_recipe.template)

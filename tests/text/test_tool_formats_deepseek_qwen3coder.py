"""The deepseek_v3 and qwen3_coder tool-call formats: calls written exactly as the models'
chat templates write them (DeepSeek-R1-Distill-Qwen's shipped template; Qwen3-Coder's
tool-call lines) parse the same at every split of the text, markers split across chunks
included; the arguments stream before a call ends; a call cut short is never text with
markup; Qwen3-Coder's values are typed by the tool's schema; the templates are detected."""
import itertools
import json

import jinja2
import pytest

from duplex.engine.text.tool_formats import TOOL_FORMATS, detect_tool_format
from duplex.engine.text.tool_parser import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from reasoning_models import reasoning_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "scale": {"type": "number"},
        "where": {"type": "object"}, "tags": {"type": "array"},
        "unit": {"enum": ["celsius", "fahrenheit"]}, "note": {"type": ["string", "null"]}}}}}

# Qwen3-Coder's chat template, its lines that write an assistant turn's tool calls
QWEN3_CODER_CALLS = """{%- for message in messages %}
{%- if message.role == "assistant" %}
{{- content }}
{%- for tool_call in message.tool_calls %}
    {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
    {%- if loop.first %}
        {%- if message.content|trim %}
            {{- message.content + '\\n\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
        {%- else %}
            {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
    {%- endif %}
    {%- if tool_call.arguments is defined %}
        {%- for args_name, args_value in tool_call.arguments|items %}
            {{- '<parameter=' + args_name + '>\\n' }}
            {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
            {{- args_value }}
            {{- '\\n</parameter>\\n' }}
        {%- endfor %}
    {%- endif %}
    {{- '</function>\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{%- endfor %}"""


def r1_reply(calls: list[tuple[str, dict]]) -> str:
    """The assistant turn DeepSeek-R1-Distill-Qwen's template writes for `calls`."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {
                     "name": name, "arguments": json.dumps(args)}} for name, args in calls]}]
    text = jinja2.Environment().from_string(reasoning_template("deepseek_r1_distill_qwen")) \
        .render(messages=messages, bos_token="", add_generation_prompt=False)
    return text.split("<｜Assistant｜>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")


def qwen3_coder_reply(content: str, calls: list[tuple[str, dict]]) -> str:
    messages = [{"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}}
        for name, args in calls]}]
    return jinja2.Environment().from_string(QWEN3_CODER_CALLS).render(messages=messages)


def parse(name: str, pieces: list[str], tools=None) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments text)]) of the events of a streaming parse, checking
    their order: text only outside calls, args deltas of the open call, each call ended."""
    parser = TOOL_FORMATS[name].new_parser(tools)
    counter = itertools.count()
    parser._new_id = lambda: f"call_{next(counter)}"
    events = [e for piece in pieces for e in parser.push(piece)] + parser.finish()
    content, calls, open_index = [], [], None
    for event in events:
        if isinstance(event, TextDelta):
            assert event.text and open_index is None
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            assert open_index is None and event.index == len(calls)
            assert event.id == f"call_{event.index}"
            open_index = event.index
            calls.append([event.name, ""])
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index == open_index and event.json_text
            calls[event.index][1] += event.json_text
        else:
            assert isinstance(event, ToolCallEnd) and event.index == open_index
            open_index = None
    assert open_index is None
    return "".join(content), [tuple(c) for c in calls]


def splits(text: str):
    """The text char by char, in two at every point, and in three at many."""
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    for cut in range(0, len(text) + 1, 7):
        for cut2 in range(cut, len(text) + 1, 11):
            yield [text[:cut], text[cut:cut2], text[cut2:]]


def assert_text_then_partial_marker(content: str, text: str, markers: tuple[str, ...],
                                    cut: int) -> None:
    """The content of a reply `text` + calls cut at `cut`: the text, then at most a cut
    start of one of `markers` (a call's, with the blanks before it), which is text."""
    if cut <= len(text):
        assert content == text[:cut], cut
    else:
        rest = content.removeprefix(text)
        assert rest == "" or any(m.startswith(rest) and rest != m for m in markers), cut


# ---------------------------------------------------------------- deepseek_v3
TWO_CALLS = [("get_weather", {"city": "Tokyo"}), ("get_time", {"zone": "Asia/Tokyo"})]

DEEPSEEK_CASES = {
    "one call": (r1_reply([("get_weather", {"city": "Paris", "days": 3})]),
                 ("", [("get_weather", '{"city": "Paris", "days": 3}')])),
    "two calls": (r1_reply(TWO_CALLS),
                  ("", [("get_weather", '{"city": "Tokyo"}'),
                        ("get_time", '{"zone": "Asia/Tokyo"}')])),
    "text before the calls": (
        "Let me check both.\n\n" + r1_reply(TWO_CALLS),
        ("Let me check both.", [("get_weather", '{"city": "Tokyo"}'),
                                ("get_time", '{"zone": "Asia/Tokyo"}')])),
    "fences and markers inside the arguments": (
        r1_reply([("run", {"code": "```py\nx = '<｜tool▁call▁begin｜>'\n```"})]),
        ("", [("run", json.dumps({"code": "```py\nx = '<｜tool▁call▁begin｜>'\n```"}))])),
    "each call its own section, text after": (
        r1_reply([("f", {})]) + "<｜tool▁calls▁end｜>\n" + r1_reply([("g", {"a": [1]})])
        + "<｜tool▁calls▁end｜> Done.",
        (" Done.", [("f", "{}"), ("g", '{"a": [1]}')])),
    "unicode": (r1_reply([("say", {"text": "你好 🙂"})]),
                ("", [("say", json.dumps({"text": "你好 🙂"}))])),
    "no fence, no arguments": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", ("", [("now", "{}")])),
    "a call without a name is text": (
        "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>b",
        ("a<｜tool▁call▁begin｜>oops<｜tool▁call▁end｜>b", [])),
    "plain text": ("just ```json``` and <｜tool▁sep｜> words",
                   ("just ```json``` and <｜tool▁sep｜> words", [])),
    "cut in the header": ("Sure.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁s",
                          ("Sure.", [])),
    "cut before the arguments": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```js", ("", [])),
    "cut in the arguments": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
        '{"city": "Par', ("", [("f", '{"city": "Par')])),
    "cut in the closing fence": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
        '{"city": "Paris"}\n``', ("", [("f", '{"city": "Paris"}')])),
    "cut in the end marker": (r1_reply([("f", {"a": 1})])[:-20], ("", [("f", '{"a": 1}')])),
    "partial marker at the end of text": ("text <｜tool▁ca", ("text <｜tool▁ca", [])),
    "blank text only": ("Hi.\n\n", ("Hi.\n\n", [])),
}


def test_the_template_writes_what_the_cases_parse():
    assert r1_reply(TWO_CALLS) == (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
        '```json\n{"zone": "Asia/Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


@pytest.mark.parametrize("case", sorted(DEEPSEEK_CASES))
def test_deepseek_every_split(case):
    text, expected = DEEPSEEK_CASES[case]
    for pieces in splits(text):
        assert parse("deepseek_v3", pieces) == expected, pieces


def test_deepseek_arguments_stream_before_the_call_ends():
    parser = TOOL_FORMATS["deepseek_v3"].new_parser()
    events = parser.push("Hm.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                         'get_weather\n```json\n{"city": "Pa')
    assert [type(e) for e in events] == [TextDelta, ToolCallStart, ToolCallArgsDelta]
    assert (events[1].name, events[2]) == ("get_weather", ToolCallArgsDelta(0, '{"city": "Pa'))
    assert parser.push('ris"}\n`') == [ToolCallArgsDelta(0, 'ris"}')]  # the fence is held
    assert parser.push("``<｜tool▁call▁end｜>") == [ToolCallEnd(0)]
    assert parser.push("<｜tool▁calls▁end｜>") == [] and parser.finish() == []


def test_deepseek_every_cut_of_a_reply_leaks_no_markup():
    text = "Checking.\n" + r1_reply(TWO_CALLS)
    for cut in range(len(text) + 1):
        content, calls = parse("deepseek_v3", [text[:cut]])
        assert_text_then_partial_marker(content, "Checking.", (
            "\n<｜tool▁calls▁begin｜>", "\n<｜tool▁call▁begin｜>", "<｜tool▁calls▁end｜>"), cut)
        for name, arguments in calls:
            assert name in ("get_weather", "get_time") and "`" not in arguments
            assert "｜" not in arguments


# ---------------------------------------------------------------- qwen3_coder
TYPED = ("get_weather", {"city": "42", "days": 3, "metric": True, "scale": 1.5,
                         "where": {"lat": 1, "lon": [2, 3]}, "tags": ["a", "b"],
                         "unit": "celsius", "note": "two\nlines  "})

QWEN_CASES = {
    "one call": (qwen3_coder_reply("", [("get_weather", {"city": "Paris"})]),
                 ("", [("get_weather", '{"city": "Paris"}')])),
    "typed by the schema": (qwen3_coder_reply("", [TYPED]),
                            ("", [("get_weather", json.dumps(TYPED[1]))])),
    "text before, two calls": (
        qwen3_coder_reply("I will look.", [("get_weather", {"city": "Oslo"}), ("now", {})]),
        ("I will look.", [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])),
    "markup inside a string value": (
        qwen3_coder_reply("", [("get_weather", {"city": "<b>x</b> </parameter"})]),
        ("", [("get_weather", '{"city": "<b>x</b> </parameter"}')])),
    "without <tool_call> and </parameter>": (
        "<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>",
        ("", [("get_weather", '{"city": "Rome", "days": 2}')])),
    "unknown parameters read as JSON where they are": (
        "<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\nhi\n"
        "</parameter>\n<parameter=q>\n\"x\"\n</parameter>\n</function>\n</tool_call>",
        ("", [("other", '{"n": 7, "s": "hi", "q": "\\"x\\""}')])),
    "a Hermes call is text": (
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', [])),
    "a function tag in prose is text": ("use <function=\nf> here", ("use <function=\nf> here", [])),
    "cut before the name": ("Sure.\n<tool_call>\n<function=get_wea", ("Sure.", [])),
    "cut in a string value": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        ("", [("get_weather", '{"city": "Par')])),
    "cut in a typed value": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n1", ("", [("get_weather", '{"city": "Paris", "days": ')])),
    "cut in </tool_call>": (qwen3_coder_reply("", [("now", {})])[:-3], ("", [("now", "{}")])),
    "plain text": ("a <tool_ca", ("a <tool_ca", [])),
}


def test_the_qwen3_coder_lines_write_what_the_cases_parse():
    assert qwen3_coder_reply("Hi.", [("get_weather", {"city": "Oslo", "metric": True})]) == (
        "Hi.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("case", sorted(QWEN_CASES))
def test_qwen3_coder_every_split(case):
    text, expected = QWEN_CASES[case]
    for pieces in splits(text):
        assert parse("qwen3_coder", pieces, [WEATHER]) == expected, pieces


def test_qwen3_coder_string_values_stream_typed_values_go_whole():
    parser = TOOL_FORMATS["qwen3_coder"].new_parser([WEATHER])
    events = parser.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fr")
    assert events[1:] == [ToolCallArgsDelta(0, '{"city": "'), ToolCallArgsDelta(0, "San Fr")]
    assert parser.push('an "C"\n') == [ToolCallArgsDelta(0, 'an \\"C\\"')]  # the \n is held
    assert parser.push("</parameter>\n<parameter=days>\n1") == [
        ToolCallArgsDelta(0, '"'), ToolCallArgsDelta(0, ', "days": ')]
    assert parser.push("4\n</parameter>\n</function>") == [
        ToolCallArgsDelta(0, "14"), ToolCallArgsDelta(0, "}"), ToolCallEnd(0)]
    assert parser.push("\n</tool_call>") == [] and parser.finish() == []


def test_qwen3_coder_without_schemas_reads_json_where_it_is():
    text = qwen3_coder_reply("", [TYPED])
    _, [(name, arguments)] = parse("qwen3_coder", [text])
    assert json.loads(arguments) == {**TYPED[1], "city": 42, "metric": "True"}


def test_qwen3_coder_every_cut_of_a_reply_leaks_no_markup():
    text = qwen3_coder_reply("Let me see.", [TYPED, ("now", {})])
    for cut in range(len(text) + 1):
        content, calls = parse("qwen3_coder", [text[:cut]], [WEATHER])
        assert_text_then_partial_marker(content, "Let me see.", ("\n\n<tool_call>",
                                                                 "\n<tool_call>"), cut)
        for name, arguments in calls:
            assert name in ("get_weather", "now") and "<" not in arguments, cut


# ---------------------------------------------------------------- detection
def test_detect_tool_format():
    assert detect_tool_format(reasoning_template("deepseek_r1_distill_qwen")) == "deepseek_v3"
    assert detect_tool_format(QWEN3_CODER_CALLS) == "qwen3_coder"
    assert detect_tool_format(reasoning_template("qwen3")) is None  # Hermes-style JSON calls
    assert detect_tool_format(None) is None and detect_tool_format("") is None

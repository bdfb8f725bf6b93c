"""Tool-call formats selectable with `--tool-call-parser`: how a model writes a call, how
its output is parsed into calls, and how a call is constrained (frontend/structured.py).

| name        | a call as the model writes it                                  | constrained |
| ----------- | -------------------------------------------------------------- | ----------- |
| hermes      | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`  | yes         |
| llama3_json | `{"name": "f", "parameters": {...}}` (several: joined by `; `)  | yes         |
| mistral     | `[TOOL_CALLS][{"name": "f", "arguments": {...}}]`              | yes         |
| pythonic    | `[f(a=1, b="x"), g()]`                                         | no: parsed  |
| deepseek_v3 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f` | yes         |
|             | `\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`    |             |
| qwen3_coder | `<tool_call>\\n<function=f>\\n<parameter=a>\\n1\\n</parameter>\\n`    | yes (xml)   |
|             | `</function>\\n</tool_call>`, values typed by the tool's schema   |             |

Hermes, deepseek_v3 and qwen3_coder stream a call's arguments as they are written: their
calls are delimited by markers that say where a call, its name and its arguments start and
end, so the name goes out as soon as it is whole and the arguments follow. deepseek_v3's
arguments are the model's JSON text, less the closing fence; qwen3_coder's are built as a
JSON object key by key, a string value streaming as written and any other value sent whole
at its `</parameter>` (its type comes from the tool's schema, `new_parser(tools)`; a value
needs all of its text to be typed). The others stream text until their start marker, then
hold the rest and parse it whole at the end: nothing marks where one of their calls ends
while it is written (a JSON or Python value is only known whole once it closes), so the call
events come at once, after the last token. A held tail that is not a call is sent as text;
one the output ended inside (max_tokens) is a cut call, never text with markup, as Hermes'
is: left out when it ended before its arguments began, else a call whose arguments are as
written (not whole JSON: a whole response leaves it out, tool_parser.without_cut_call).
`detect_tool_format` names the format a chat template writes, where only one fits.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Callable

from duplex.engine.text.tool_parser import (HermesFormat, TextDelta, ToolCallArgsDelta, ToolCallEnd,
                                     ToolCallParser, ToolCallStart, _final_args, _json_string,
                                     _partial_tag, new_call_id)

_DECODER = json.JSONDecoder()


class _HeldCallParser:
    """Text streams until one of `markers`; from the first marker on, the output is held and
    `parse` (text -> [(name, arguments JSON)] or None) decides at finish()."""

    def __init__(self, markers: tuple[str, ...], parse: Callable[[str], list | None],
                 id_factory: Callable[[], str] = new_call_id) -> None:
        self._markers, self._parse, self._new_id = markers, parse, id_factory
        self._pending = ""
        self._held: str | None = None

    def push(self, text: str) -> list:
        if self._held is not None:
            self._held += text
            return []
        self._pending += text
        hits = [i for i in (self._pending.find(m) for m in self._markers) if i >= 0]
        if hits:
            at = min(hits)
            out, self._held = self._pending[:at], self._pending[at:]
            self._pending = ""
            return [TextDelta(out)] if out else []
        keep = max(_partial_tag(self._pending, m) for m in self._markers)
        out, self._pending = self._pending[:len(self._pending) - keep], \
            self._pending[len(self._pending) - keep:]
        return [TextDelta(out)] if out else []

    def finish(self) -> list:
        """The held text's calls (an empty list: a call cut before its arguments, dropped),
        or the text itself when it is not calls."""
        if self._held is None:
            return [TextDelta(self._pending)] if self._pending else []
        calls = self._parse(self._held)
        if calls is None:
            return [TextDelta(self._held)]
        events: list = []
        for index, (name, arguments) in enumerate(calls):
            events += [ToolCallStart(index, self._new_id(), name),
                       ToolCallArgsDelta(index, arguments), ToolCallEnd(index)]
        return events


def _json_calls(text: str, args_keys: tuple[str, ...], separators: str) -> list | None:
    """Consecutive JSON objects {"name": ..., <args key>: {...}} separated by `separators`
    characters and blanks -> [(name, arguments JSON)], or None if the text is not that.
    Where the text ends inside an object (a cut call), that call is left out, or kept with
    its arguments as written once they began (`_cut_call`); `text` is what follows a call
    marker, so an empty one is a call cut before it began."""
    calls, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):  # no call at all: a marker the output ended after, cut
            return calls
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return _cut_call(calls, text[pos:], args_keys)
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = next((item[k] for k in args_keys if k in item), {})
            calls.append((item["name"], args if isinstance(args, str)
                          else json.dumps(args, ensure_ascii=False)))


def _cut_call(calls: list, rest: str, args_keys: tuple[str, ...]) -> list | None:
    """`calls` and the call `rest` was cut in (it starts a call's JSON object but never
    closes): with its arguments as written when its name and arguments began, else none;
    None when `rest` is not the start of a call (the text is not calls)."""
    keys = "|".join(re.escape(k) for k in args_keys)
    header = re.match(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + keys +
                      r')"\s*:\s*(?=\S)', rest)
    name = _json_string(header[1]) if header else None
    if name is not None:
        return calls + [(name, _final_args(rest[header.end():]))]
    return calls if _HEADER_PREFIX.fullmatch(rest) else None


def _prefixes(pieces: list[str]) -> re.Pattern:
    """A pattern matching every prefix of the concatenation of `pieces` (regexes)."""
    pattern = ""
    for piece in reversed(pieces):
        pattern = piece + (f"(?:{pattern})?" if pattern else "")
    return re.compile(pattern)


# every start of a call object up to its arguments: `{"name": "f", "parameters": `
_HEADER_PREFIX = _prefixes([r"\{\s*", '"', "n", "a", "m", "e", r'"\s*', r":\s*",
                            r'"(?:[^"\\]|\\.)*', r'"\s*', r",\s*", r'"[a-z]*', r'"\s*',
                            r":\s*"])


class Llama3JsonFormat:
    """Llama 3.1 / 3.2 JSON tool calls."""
    name = "llama3_json"
    trigger = '{"name": "'
    separator = "; "
    can_constrain = True

    @staticmethod
    def tag(name: str, arguments: dict) -> dict:
        return {"type": "tag", "begin": '{"name": ' + json.dumps(name) + ', "parameters": ',
                "content": arguments, "end": "}"}

    @staticmethod
    def new_parser(tools: list[dict] | None = None) -> _HeldCallParser:
        return _HeldCallParser(('{"name"', "<|python_tag|>"), lambda text: _json_calls(
            text.replace("<|python_tag|>", ""), ("parameters", "arguments"), ";"))


class MistralFormat:
    """Mistral's `[TOOL_CALLS]` + a JSON array of calls. With skip_special_tokens (the
    default) the `[TOOL_CALLS]` token is not in the text: a bare `[{"name"` starts a call."""
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    separator = ""
    can_constrain = True

    @staticmethod
    def tag(name: str, arguments: dict) -> dict:
        return {"type": "tag",
                "begin": '[TOOL_CALLS][{"name": ' + json.dumps(name) + ', "arguments": ',
                "content": arguments, "end": "}]"}

    @staticmethod
    def new_parser(tools: list[dict] | None = None) -> _HeldCallParser:
        # the array's brackets and commas read as separators: a cut array keeps its whole calls
        return _HeldCallParser(("[TOOL_CALLS]", '[{"name"'), lambda text: _json_calls(
            text.replace("[TOOL_CALLS]", ""), ("arguments", "parameters"), "[,]"))


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\(")


class PythonicFormat:
    """Calls as a Python list of calls with literal keyword arguments (Llama 4, Llama 3.2
    small models). Parsed, not constrained: xgrammar has no pythonic-arguments format."""
    name = "pythonic"
    trigger = "["
    separator = ", "
    can_constrain = False

    @staticmethod
    def new_parser(tools: list[dict] | None = None) -> _HeldCallParser:
        return _HeldCallParser(("[",), _pythonic_calls)


def _pythonic_calls(text: str) -> list | None:
    text = text.strip()
    if not _PYTHONIC_START.match(text):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        calls.append((ast.unparse(node.func), json.dumps(args, ensure_ascii=False)))
    return calls


# ---------------------------------------------------------------- markup formats
class _MarkupCallParser:
    """The frame of the streaming markup parsers (DeepSeek-V3, Qwen3-Coder): the pending
    text is cut at markers by the current state's step (`_in_<state>`, True when it
    consumed something), calls are numbered in order, and blank text beside calls is not
    content: the trailing blanks of the text so far are held back and dropped when a call
    follows, or at the end when there was a call (as Hermes does, tool_parser.py). A call
    cut short before its name is dropped; one cut after it ends with the arguments as far
    as they were written, never completed."""

    def __init__(self, id_factory: Callable[[], str]) -> None:
        self._new_id = id_factory
        self._pending = ""  # text not yet consumed (ends, at most, in a partial marker)
        self._state = "text"
        self._num_calls = 0
        self._blank = ""    # trailing blanks of the text so far, held back

    def push(self, text: str) -> list:
        events: list = []
        self._pending += text
        while getattr(self, "_in_" + self._state)(events):
            pass
        return events

    def finish(self) -> list:
        events: list = []
        if self._state == "text":
            self._text(events, self._pending)
            if self._blank and not self._num_calls:
                events.append(TextDelta(self._blank))
        elif self._state in self._OPEN_CALL_STATES:
            events.append(ToolCallEnd(self._num_calls - 1))
        self._pending, self._blank, self._state = "", "", "text"
        return events

    _OPEN_CALL_STATES: tuple[str, ...] = ()  # states inside a call whose name went out

    def _take(self, markers: tuple[str, ...]) -> tuple[str, str | None]:
        """(the pending text before the first of `markers`, that marker), both consumed;
        with none of them whole: (the text that cannot start one, None)."""
        hits = [(at, -len(m), m) for m in markers if (at := self._pending.find(m)) >= 0]
        if hits:
            at, _, marker = min(hits)
            chunk, self._pending = self._pending[:at], self._pending[at + len(marker):]
            return chunk, marker
        keep = max(_partial_tag(self._pending, m) for m in markers)
        cut = len(self._pending) - keep
        chunk, self._pending = self._pending[:cut], self._pending[cut:]
        return chunk, None

    def _text(self, events: list, text: str) -> None:
        text = self._blank + text
        body = text.rstrip()
        if body:
            events.append(TextDelta(body))
        self._blank = text[len(body):]

    def _start_call(self, events: list, name: str) -> int:
        self._blank = ""
        index, self._num_calls = self._num_calls, self._num_calls + 1
        events.append(ToolCallStart(index, self._new_id(), name))
        return index


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_FENCES = ("```json\n", "```\n")
_FENCE_TAIL = " \t\r\n`"  # what may stand between the arguments and the call's end marker


class _DeepSeekV3Parser(_MarkupCallParser):
    """States: text -> (calls begin) section -> (call begin) header -> (`NAME\\n```json\\n`)
    args -> (call end) section -> (calls end) text. The arguments stream as written, less
    the closing fence, which is held back until it turns out not to be one."""
    _OPEN_CALL_STATES = ("args",)

    def __init__(self, id_factory: Callable[[], str] = new_call_id) -> None:
        super().__init__(id_factory)
        self._args = ""
        self._num_emitted = 0

    def _in_text(self, events: list) -> bool:
        chunk, marker = self._take((DS_CALLS_BEGIN, DS_CALL_BEGIN))
        self._text(events, chunk)
        if marker is None:
            return False
        self._state = "section" if marker == DS_CALLS_BEGIN else "header"
        return True

    def _in_section(self, events: list) -> bool:
        _, marker = self._take((DS_CALL_BEGIN, DS_CALLS_END))  # blanks between calls: dropped
        if marker is None:
            return False
        self._state = "header" if marker == DS_CALL_BEGIN else "text"
        return True

    def _in_header(self, events: list) -> bool:
        end = self._pending.find(DS_CALL_END)
        head = _deepseek_header(self._pending if end < 0 else self._pending[:end],
                                is_whole=end >= 0)
        if head is not None:
            name, args_start = head
            self._pending = self._pending[args_start:]
            self._start_call(events, name)
            self._state, self._args, self._num_emitted = "args", "", 0
            return True
        if end < 0:
            return False
        # a whole call without a name: not a call, its markup is text
        self._text(events, DS_CALL_BEGIN + self._pending[:end] + DS_CALL_END)
        self._pending, self._state = self._pending[end + len(DS_CALL_END):], "section"
        return True

    def _in_args(self, events: list) -> bool:
        chunk, marker = self._take((DS_CALL_END,))
        self._args += chunk
        args = self._args.rstrip(_FENCE_TAIL)
        if marker is not None and not args:
            args = "{}"
        if len(args) > self._num_emitted:
            events.append(ToolCallArgsDelta(self._num_calls - 1, args[self._num_emitted:]))
            self._num_emitted = len(args)
        if marker is None:
            return False
        events.append(ToolCallEnd(self._num_calls - 1))
        self._state = "section"
        return True


def _deepseek_header(text: str, is_whole: bool) -> tuple[str, int] | None:
    """(name, where the arguments start) of a call's text `TYPE<｜tool▁sep｜>NAME\\n```json\\n`
    once that header is complete; None while it is not (or, in a whole call, has no name)."""
    sep = text.find(DS_SEP)
    if sep < 0:
        return None
    line_end = text.find("\n", sep)
    if line_end < 0 and not is_whole:
        return None
    line_end = len(text) if line_end < 0 else line_end
    name = text[sep + len(DS_SEP):line_end].strip()
    start = min(line_end + 1, len(text))
    rest = text[start:]
    fence = next((f for f in _DS_FENCES if rest.startswith(f)), "")
    if not name or (not fence and not is_whole and any(f.startswith(rest) for f in _DS_FENCES)):
        return None
    return name, start + len(fence)


class DeepSeekV3Format:
    """DeepSeek-V3 / R1 (and the R1 distills' template): calls in the model's tool-call
    tokens, their arguments JSON in a fenced block, several calls in one section:
    `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
    <｜tool▁call▁end｜>\\n<｜tool▁call▁begin｜>...<｜tool▁calls▁end｜>`. Constrained, each call
    is a section of its own (as SGLang constrains it); the parser takes both. The markers
    are read from the text: a tokenizer that marks them special needs them decoded."""
    name = "deepseek_v3"
    trigger = DS_CALLS_BEGIN
    separator = "\n"
    can_constrain = True

    @staticmethod
    def tag(name: str, arguments: dict) -> dict:
        return {"type": "tag",
                "begin": f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n",
                "content": arguments, "end": f"\n```{DS_CALL_END}{DS_CALLS_END}"}

    @staticmethod
    def new_parser(tools: list[dict] | None = None) -> _DeepSeekV3Parser:
        return _DeepSeekV3Parser()


QC_CALL_OPEN, QC_CALL_CLOSE = "<tool_call>", "</tool_call>"
QC_FUNCTION_OPEN, QC_FUNCTION_CLOSE = "<function=", "</function>"
QC_PARAMETER_OPEN, QC_PARAMETER_CLOSE = "<parameter=", "</parameter>"


class _Qwen3CoderParser(_MarkupCallParser):
    """States: text -> (`<tool_call>`) call -> (`<function=`) name -> (`>`) params ->
    (`<parameter=`) key -> (`>`) value -> (`</parameter>`) params -> (`</function>`) after
    -> (`</tool_call>`) text. A bare `<function=` (no `<tool_call>`) starts a call too. The
    arguments go out as a JSON object, key by key: a string parameter's value streams as it
    is written (less the newline the template puts on each side), any other is sent whole
    at `</parameter>`, typed by the tool's schema (`_typed_value`)."""
    _OPEN_CALL_STATES = ("params", "key", "value")

    def __init__(self, tools: list[dict] | None = None,
                 id_factory: Callable[[], str] = new_call_id) -> None:
        super().__init__(id_factory)
        self._schemas = _parameter_schemas(tools)  # function name -> parameter -> schema
        self._body = ""  # call / name / key: what was written so far; value: the value
        self._params: dict = {}   # the open call's parameter schemas
        self._num_params = 0      # parameters of the open call so far
        self._schema: dict | None = None  # the open parameter's schema
        self._num_emitted = 0     # characters of a streamed string value sent

    def _in_text(self, events: list) -> bool:
        chunk, marker = self._take((QC_CALL_OPEN, QC_FUNCTION_OPEN))
        self._text(events, chunk)
        if marker is None:
            return False
        self._state = "call" if marker == QC_CALL_OPEN else "name"
        self._body = "" if marker == QC_CALL_OPEN else QC_FUNCTION_OPEN
        return True

    def _in_call(self, events: list) -> bool:
        chunk, marker = self._take((QC_FUNCTION_OPEN, QC_CALL_CLOSE))
        self._body += chunk
        if marker == QC_FUNCTION_OPEN and not self._body.strip():
            self._state, self._body = "name", QC_CALL_OPEN + QC_FUNCTION_OPEN
            return True
        if marker is None and not self._body.strip():
            return False
        # not a call: what was taken for one is text
        self._text(events, QC_CALL_OPEN + self._body + (marker or ""))
        self._state = "text"
        return True

    def _in_name(self, events: list) -> bool:
        chunk, marker = self._take((">",))
        self._body += chunk
        name = self._body.partition(QC_FUNCTION_OPEN)[2]
        is_name = "\n" not in name and "<" not in name
        if marker is None and is_name:
            return False
        name = name.strip()
        if not is_name or not name:  # not a call: text
            self._text(events, self._body + (marker or ""))
            self._state = "text"
            return True
        self._start_call(events, name)
        self._params, self._num_params = self._schemas.get(name, {}), 0
        self._state = "params"
        return True

    def _in_params(self, events: list) -> bool:
        _, marker = self._take((QC_PARAMETER_OPEN, QC_FUNCTION_CLOSE, QC_CALL_CLOSE))
        if marker is None:
            return False
        if marker == QC_PARAMETER_OPEN:
            self._state, self._body = "key", ""
        else:
            self._end_call(events, "after" if marker == QC_FUNCTION_CLOSE else "text")
        return True

    def _in_key(self, events: list) -> bool:
        chunk, marker = self._take((">",))
        self._body += chunk
        if marker is None:
            return False
        key = self._body.strip()
        self._schema = self._params.get(key)
        opening = "{" if not self._num_params else ", "
        self._num_params += 1
        quote = '"' if _schema_type(self._schema) == "string" else ""
        events.append(ToolCallArgsDelta(self._num_calls - 1,
                                        opening + json.dumps(key, ensure_ascii=False) + ": "
                                        + quote))
        self._state, self._body, self._num_emitted = "value", "", 0
        return True

    def _in_value(self, events: list) -> bool:
        chunk, marker = self._take((QC_PARAMETER_CLOSE, QC_PARAMETER_OPEN, QC_FUNCTION_CLOSE))
        self._body += chunk
        self._emit_value(events, is_whole=marker is not None)
        if marker is None:
            return False
        if marker == QC_PARAMETER_OPEN:  # `</parameter>` left out
            self._state, self._body = "key", ""
        elif marker == QC_FUNCTION_CLOSE:
            self._end_call(events, "after")
        else:
            self._state = "params"
        return True

    def _in_after(self, events: list) -> bool:
        self._pending = self._pending.lstrip()
        if self._pending.startswith(QC_CALL_CLOSE):
            self._pending = self._pending[len(QC_CALL_CLOSE):]
        elif QC_CALL_CLOSE.startswith(self._pending):
            return False  # may still be `</tool_call>`
        self._state = "text"
        return True

    def _emit_value(self, events: list, is_whole: bool) -> None:
        """A string value streams, less one newline at each end; any other goes out whole."""
        value = self._body[1:] if self._body.startswith("\n") else self._body
        if value.endswith("\n"):  # the template's, or (not yet whole) may be
            value = value[:-1]
        index = self._num_calls - 1
        if _schema_type(self._schema) != "string":
            if is_whole:
                text = json.dumps(_typed_value(value, self._schema), ensure_ascii=False)
                events.append(ToolCallArgsDelta(index, text))
            return
        text = json.dumps(value[self._num_emitted:], ensure_ascii=False)[1:-1]
        self._num_emitted = len(value)
        text += '"' if is_whole else ""
        if text:
            events.append(ToolCallArgsDelta(index, text))

    def _end_call(self, events: list, state: str) -> None:
        index = self._num_calls - 1
        events += [ToolCallArgsDelta(index, "}" if self._num_params else "{}"),
                   ToolCallEnd(index)]
        self._state = state


def _parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """function name -> {parameter: its JSON schema}, from OpenAI-shaped tools."""
    out = {}
    for tool in tools or []:
        function = tool.get("function", tool)
        parameters = function.get("parameters") or {}
        out[function.get("name")] = parameters.get("properties") or {}
    return out


def _schema_type(schema: dict | None) -> str | None:
    """The JSON type a parameter's schema asks for (the first besides null), or None."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None and schema.get("enum") and all(isinstance(v, str) for v in schema["enum"]):
        return "string"
    return kind if isinstance(kind, str) else None


def _typed_value(text: str, schema: dict | None):
    """A parameter's value as the schema types it: a string is the text itself; anything
    else is the text read as JSON (Python's True/False for a boolean too, as the template
    writes them). Text that is not such JSON stays a string; with no schema, text that reads
    as JSON other than a string is that value."""
    kind = _schema_type(schema)
    if kind == "string":
        return text
    stripped = text.strip()
    if kind == "boolean" and stripped in ("True", "False"):
        return stripped == "True"
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        return text
    return text if isinstance(value, str) else value


class Qwen3CoderFormat:
    """Qwen3-Coder's XML-style calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
    \\n</parameter>\\n</function>\\n</tool_call>`, one per call, separated by a newline."""
    name = "qwen3_coder"
    trigger = QC_CALL_OPEN
    separator = "\n"
    can_constrain = True

    @staticmethod
    def tag(name: str, arguments: dict) -> dict:
        return {"type": "tag", "begin": f"{QC_CALL_OPEN}\n{QC_FUNCTION_OPEN}{name}>\n",
                "content": {**arguments, "style": "qwen_xml"},
                "end": f"{QC_FUNCTION_CLOSE}\n{QC_CALL_CLOSE}"}

    @staticmethod
    def new_parser(tools: list[dict] | None = None) -> _Qwen3CoderParser:
        return _Qwen3CoderParser(tools)


def detect_tool_format(template: str | None) -> str | None:
    """The format a chat template writes its calls in, when only one fits: DeepSeek's
    tool-call tokens, or Qwen3-Coder's `<function=` / `<parameter=` tags. None otherwise."""
    if not template:
        return None
    if DS_CALLS_BEGIN in template:
        return DeepSeekV3Format.name
    if QC_FUNCTION_OPEN in template and QC_PARAMETER_OPEN in template:
        return Qwen3CoderFormat.name
    return None


class _Hermes(HermesFormat):
    name = "hermes"
    can_constrain = True

    @staticmethod
    def new_parser(tools: list[dict] | None = None) -> ToolCallParser:
        return ToolCallParser()


TOOL_FORMATS = {f.name: f for f in (_Hermes, Llama3JsonFormat, MistralFormat, PythonicFormat,
                                     DeepSeekV3Format, Qwen3CoderFormat)}


def tool_format(name: str):
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from "
                         f"{', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]

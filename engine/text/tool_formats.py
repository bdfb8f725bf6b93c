"""Tool-call formats selectable with `--tool-call-parser`: how a model writes a call, how
its output is parsed into calls, and how a call is constrained (frontend/structured.py).

| name        | a call as the model writes it                                  | constrained |
| ----------- | -------------------------------------------------------------- | ----------- |
| hermes      | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`  | yes         |
| llama3_json | `{"name": "f", "parameters": {...}}` (several: joined by `; `)  | yes         |
| mistral     | `[TOOL_CALLS][{"name": "f", "arguments": {...}}]`              | yes         |
| pythonic    | `[f(a=1, b="x"), g()]`                                         | no: parsed  |

Hermes streams a call's arguments as they are written (tool_parser.ToolCallParser). The
others stream text until their start marker, then hold the rest and parse it whole at the
end: the call events come at once, after the last token. A held tail that is not a call
is sent as text.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Callable

from duplex.engine.text.tool_parser import (HermesFormat, TextDelta, ToolCallArgsDelta, ToolCallEnd,
                                     ToolCallParser, ToolCallStart, _partial_tag, new_call_id)

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
    characters and blanks -> [(name, arguments JSON)], or None if the text is not that."""
    calls, pos = [], 0
    while pos < len(text):
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = next((item[k] for k in args_keys if k in item), {})
            calls.append((item["name"], args if isinstance(args, str)
                          else json.dumps(args, ensure_ascii=False)))
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
    return calls or None


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
    def new_parser() -> _HeldCallParser:
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
    def new_parser() -> _HeldCallParser:
        return _HeldCallParser(("[TOOL_CALLS]", '[{"name"'), lambda text: _json_calls(
            text.replace("[TOOL_CALLS]", ""), ("arguments", "parameters"), ""))


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\(")


class PythonicFormat:
    """Calls as a Python list of calls with literal keyword arguments (Llama 4, Llama 3.2
    small models). Parsed, not constrained: xgrammar has no pythonic-arguments format."""
    name = "pythonic"
    trigger = "["
    separator = ", "
    can_constrain = False

    @staticmethod
    def new_parser() -> _HeldCallParser:
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


class _Hermes(HermesFormat):
    name = "hermes"
    can_constrain = True

    @staticmethod
    def new_parser() -> ToolCallParser:
        return ToolCallParser()


TOOL_FORMATS = {f.name: f for f in (_Hermes, Llama3JsonFormat, MistralFormat, PythonicFormat)}


def tool_format(name: str):
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from "
                         f"{', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]

"""Tool calls in model output, Hermes/Qwen style, parsed as the text streams in.

Owns: the parse state of one output stream. The format:

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><tool_call>...</tool_call>

A call is *committed* once its body starts with `{"name": "...", "arguments": ` followed by a
non-blank character: ToolCallStart goes out, and the arguments stream as raw JSON text (holding
back trailing blanks and one `}`, which may be the closing brace of the outer object). A body
that never commits is judged whole at `</tool_call>`: a JSON object with "name" (and
"arguments") in any key order is a call, anything else is plain text, tags included.

Where the output ends (`finish()`: end of text, max_tokens, a stop string) inside a call, the
call was cut, and markup is never text: a committed call ends with its arguments as written
(a partial closing tag is not part of them; `is_whole_json` tells a cut call from one whose
tag alone was cut), an uncommitted body that starts a JSON object is dropped, and only an
unterminated tag followed by prose stays text.

Blank text beside calls is not content: the trailing blanks of the text so far are held
back, and dropped when a call starts or when the output ends after one (so the newline
between parallel calls never becomes assistant text); any other text releases them.
The one-shot `parse_tool_calls` runs the same parser, so streaming and one-shot agree for every
split of the text.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Callable, NamedTuple, Union

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class TextDelta(NamedTuple):
    text: str


class ToolCallStart(NamedTuple):
    index: int
    id: str
    name: str


class ToolCallArgsDelta(NamedTuple):
    index: int
    json_text: str


class ToolCallEnd(NamedTuple):
    index: int


Event = Union[TextDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _OpenCall:
    """The committed call being streamed: where its arguments start, how much went out."""

    def __init__(self, index: int, args_start: int):
        self.index, self.args_start, self.num_emitted = index, args_start, 0


class ToolCallParser:
    """Streaming parser: `push` text deltas, then `finish` once; both return events."""

    def __init__(self, id_factory: Callable[[], str] = new_call_id):
        self._new_id = id_factory
        self._pending = ""            # text not yet consumed (a possible partial tag)
        self._body: str | None = None  # inside <tool_call>: the body so far, else None
        self._call: _OpenCall | None = None
        self._num_calls = 0
        self._blank = ""               # trailing blanks of the text so far, held back

    def push(self, text_delta: str) -> list[Event]:
        events: list[Event] = []
        self._pending += text_delta
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        pending, self._pending = self._pending, ""
        is_cut_call = self._body is not None and _starts_object(self._body + pending)
        if self._body is None:
            self._text(events, pending)
        elif self._call is not None:  # `pending` can only be a partial closing tag
            self._stream_args(events, final=True)
        elif not is_cut_call:
            self._text(events, OPEN_TAG + self._body + pending)
        self._body, self._call = None, None
        if not (self._num_calls or is_cut_call):
            _add_text(events, self._blank)
        self._blank = ""
        return events

    def _step(self, events: list[Event]) -> bool:
        """Consume pending text up to the next tag; True when a tag was consumed."""
        tag = OPEN_TAG if self._body is None else CLOSE_TAG
        at = self._pending.find(tag)
        cut = at if at >= 0 else len(self._pending) - _partial_tag(self._pending, tag)
        chunk, self._pending = self._pending[:cut], self._pending[cut:]
        if self._body is None:
            self._text(events, chunk)
        else:
            self._body += chunk
        if at < 0:
            if self._body is not None:
                self._advance(events)
            return False
        self._pending = self._pending[len(tag):]
        if self._body is None:
            self._body, self._call = "", None
        else:
            self._close(events)
        return True

    def _advance(self, events: list[Event]) -> None:
        if self._call is None:
            header = _HEADER.match(self._body)
            name = _json_string(header[1]) if header else None
            if name is None:
                return
            self._call = _OpenCall(self._num_calls, header.end())
            self._num_calls += 1
            self._blank = ""
            events.append(ToolCallStart(self._call.index, self._new_id(), name))
        self._stream_args(events, final=False)

    def _close(self, events: list[Event]) -> None:
        self._advance(events)
        if self._call is not None:
            self._stream_args(events, final=True)
        else:
            call = _whole_call(self._body)
            if call is None:
                self._text(events, OPEN_TAG + self._body + CLOSE_TAG)
            else:
                index, self._num_calls = self._num_calls, self._num_calls + 1
                self._blank = ""
                events += [ToolCallStart(index, self._new_id(), call[0]),
                           ToolCallArgsDelta(index, call[1]), ToolCallEnd(index)]
        self._body, self._call = None, None

    def _text(self, events: list[Event], text: str) -> None:
        """Add plain text, holding back its trailing blanks (see the module docstring)."""
        text = self._blank + text
        kept = text.rstrip()
        self._blank = text[len(kept):]
        _add_text(events, kept)

    def _stream_args(self, events: list[Event], final: bool) -> None:
        call = self._call
        text = self._body[call.args_start:]
        args = _final_args(text) if final else _strip_outer_close(text)
        if len(args) > call.num_emitted:
            events.append(ToolCallArgsDelta(call.index, args[call.num_emitted:]))
            call.num_emitted = len(args)
        if final:
            events.append(ToolCallEnd(call.index))


def parse_tool_calls(text: str, id_factory: Callable[[], str] = new_call_id
                     ) -> tuple[str, list[dict]]:
    """One-shot: (content without the calls, OpenAI-shaped tool calls)."""
    parser = ToolCallParser(id_factory)
    content: list[str] = []
    calls: list[dict] = []
    for event in parser.push(text) + parser.finish():
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls.append({"id": event.id, "type": "function",
                          "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, ToolCallArgsDelta):
            calls[event.index]["function"]["arguments"] += event.json_text
    return "".join(content), calls


def is_whole_json(text: str) -> bool:
    """Whether `text` (a call's arguments) is one whole JSON value: false for the arguments of
    a call cut short by max_tokens."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def without_cut_call(calls: list, is_cut: bool) -> list:
    """`calls` (in order, each with `.arguments`) less the last one when the output was cut
    (`is_cut`: max_tokens) inside it: a whole response never returns a cut call."""
    if is_cut and calls and not is_whole_json(calls[-1].arguments):
        return calls[:-1]
    return calls


def forced_call_prefix(tool_names: list[str], name: str | None) -> str:
    """The start of the assistant turn that makes the model call a tool: `name`'s call up to
    its arguments, or, with no name, a call whose name the model writes (one tool: that one).
    Hermes-style, the way the templates `tools_supported` accepts render a call."""
    if name is None and len(tool_names) == 1:
        name = tool_names[0]
    if name is None:
        return OPEN_TAG + '\n{"name": "'
    return OPEN_TAG + '\n{"name": ' + json.dumps(name) + ', "arguments": '


class HermesFormat:
    """How a Hermes-style call is written, for constrained decoding (frontend/structured.py):
    each call a tag `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`."""
    trigger = OPEN_TAG
    separator = "\n"

    @staticmethod
    def tag(name: str, arguments: dict) -> dict:
        """The structural tag of one call of `name`; arguments: its content format."""
        return {"type": "tag", "begin": forced_call_prefix([name], name),
                "content": arguments, "end": "}\n" + CLOSE_TAG}


def tools_supported(template: str | None) -> bool:
    """Whether a chat template renders tools and asks for Hermes-style <tool_call> output."""
    return bool(template) and OPEN_TAG in template and re.search(r"\btools\b", template) is not None


def _add_text(events: list[Event], text: str) -> None:
    if text:
        events.append(TextDelta(text))


def _starts_object(body: str) -> bool:
    """Whether an unterminated call body is (the start of) a JSON object: a cut call."""
    rest = body.lstrip()
    return not rest or rest[0] == "{"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _strip_outer_close(args: str) -> str:
    """Arguments text without trailing blanks, one `}` (the outer object's) and blanks."""
    end = len(args.rstrip())
    if end and args[end - 1] == "}":
        end = len(args[:end - 1].rstrip())
    return args[:end]


def _final_args(text: str) -> str:
    """The arguments value of a finished body: the JSON value when only blanks and at most one
    `}` follow it (the outer brace may be missing), else the stripped text as it is."""
    try:
        _, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return _strip_outer_close(text)
    return text[:end] if _strip_outer_close(text[end:]) == "" else _strip_outer_close(text)


def _json_string(escaped: str) -> str | None:
    try:
        return json.loads('"' + escaped + '"')
    except (ValueError, RecursionError):
        return None


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete body, or None when it is not a call."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # model text nested past the parser's depth
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return value["name"], arguments

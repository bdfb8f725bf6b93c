"""Minimal stand-ins for `frontend.stop` and `frontend.tool_parser`, installed only while
those modules have not landed, so the frontend tests run against their interfaces."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types


class StopChecker:
    def __init__(self, stop: list[str], include_stop_str: bool = False) -> None:
        self.stop = list(stop)
        self.include = include_stop_str
        self.held = ""
        self.keep = max(len(s) for s in self.stop) - 1 if self.stop else 0

    def push(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        hits = [(buf.find(s), s) for s in self.stop if s in buf]
        if hits:
            pos, s = min(hits)
            self.held = ""
            return buf[:pos + (len(s) if self.include else 0)], True
        cut = max(0, len(buf) - self.keep)
        self.held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


@dataclasses.dataclass
class TextDelta:
    text: str


@dataclasses.dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclasses.dataclass
class ToolCallArgsDelta:
    index: int
    json_text: str


@dataclasses.dataclass
class ToolCallEnd:
    index: int


OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolCallParser:
    """Hermes style: <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

    def __init__(self) -> None:
        self.buf = ""
        self.count = 0

    def push(self, text: str) -> list:
        self.buf += text
        events: list = []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = next((k for k in range(len(OPEN) - 1, 0, -1)
                             if self.buf.endswith(OPEN[:k])), 0)
                cut = len(self.buf) - keep
                if cut:
                    events.append(TextDelta(self.buf[:cut]))
                self.buf = self.buf[cut:]
                return events
            if start:
                events.append(TextDelta(self.buf[:start]))
                self.buf = self.buf[start:]
            end = self.buf.find(CLOSE)
            if end < 0:
                return events
            call = json.loads(self.buf[len(OPEN):end])
            index, self.count = self.count, self.count + 1
            events += [ToolCallStart(index, f"call_{index}", call["name"]),
                       ToolCallArgsDelta(index, json.dumps(call.get("arguments", {}))),
                       ToolCallEnd(index)]
            self.buf = self.buf[end + len(CLOSE):]

    def finish(self) -> list:
        text, self.buf = self.buf, ""
        return [TextDelta(text)] if text else []


def install() -> None:
    for name, members in (("frontend.stop", [StopChecker]),
                          ("frontend.tool_parser", [TextDelta, ToolCallStart, ToolCallArgsDelta,
                                                    ToolCallEnd, ToolCallParser])):
        if importlib.util.find_spec(name) is None and name not in sys.modules:
            module = types.ModuleType(name)
            for member in members:
                setattr(module, member.__name__, member)
            sys.modules[name] = module

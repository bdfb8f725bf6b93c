"""The recipe: chat messages become exactly the token ids the model expects, injection-safe.

Owns: message validation, the sandboxed rendering of chat templates (time, step and size
limits), and the encoder that lets only the template's own text produce control tokens.

How template text is told apart from user text
----------------------------------------------
The template is rendered twice from the same messages:

* faithfully, with the real strings: the text transformers' `apply_chat_template` tokenizes;
* symbolically, with every user string (content, names, ids, tool schemas, tool-call
  arguments; also dict keys) replaced by a `_UserText`: a str whose characters are a unique
  placeholder but whose methods and comparisons act on the real text, so the template branches,
  strips, splits and JSON-escapes exactly as on the real string and each result is a new
  placeholder.

Splitting the symbolic output on placeholders and putting the real text back yields the faithful
text with every character labelled "template" or "user". If the two texts differ the template
did something to user text that cannot be traced, and the request fails (RecipeError) instead
of guessing. Only roles and `"type": "function"`, validated against fixed values, stay plain.

Encoding: when no control token's text occurs outside the template-written stretches, the
faithful text is tokenized exactly as transformers does, and every control token in the result
is checked (by its offsets) to lie inside one template stretch; benign chats take this path, so
they match transformers by construction. Otherwise the text is cut at the template's control
tokens and each section between them is tokenized with every control token switched off, so a
user's `<|im_end|>` becomes the plain-text tokens for those characters.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import json
import os
import re
import secrets
import time
from contextvars import ContextVar
from datetime import datetime
from typing import Any, NamedTuple

import markupsafe
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from frontend.detokenizer import IncrementalDetokenizer
from frontend.tokenizer import (chat_template, control_tokens, eos_token_ids, load_tokenizer,
                                text_encoder)


class RecipeError(ValueError):
    """A chat the recipe refuses: malformed messages, or a template that fails or misbehaves."""


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """What rendering one chat may spend; a template that exceeds any of them fails."""
    seconds: float = 1.0            # wall time, both renders together
    steps: int = 1_000_000          # per render: loop iterations, calls, attribute/item lookups
    chars: int = 16_000_000         # longest string the template may build, output included
    built: int = 256_000_000        # per render: chars + items of all strings/lists it builds
    template_chars: int = 256_000   # longest template source accepted
    int_arg: int = 100_000          # largest number a filter or method takes (widths, counts)

    def __post_init__(self):
        if min(dataclasses.astuple(self)) <= 0:
            raise ValueError(f"render limits must be positive: {self}")


class Rendered(NamedTuple):
    """A rendered chat: its text and the (start, end) stretches the template itself wrote."""
    text: str
    template_spans: list[tuple[int, int]]


# ---------------------------------------------------------------------------------------------
# Message validation: OpenAI-shaped dicts in, plain JSON-typed dicts out.

ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant", "tool": "tool"}
_MAX_JSON_DEPTH = 64
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def normalize_messages(messages: Any) -> list[dict]:
    """Validated copies of OpenAI-style messages, content flattened to one string."""
    if not isinstance(messages, list) or not messages:
        raise RecipeError("messages must be a non-empty list")
    return [_normalize_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _normalize_message(where: str, message: Any) -> dict:
    if not isinstance(message, dict):
        raise RecipeError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise RecipeError(f"{where}.role must be one of {sorted(ROLES)}, got {_short(role)}")
    tool_calls = message.get("tool_calls")
    content = message.get("content")
    if content is None and not (role == "assistant" and tool_calls):
        raise RecipeError(f"{where}.content is required")
    out = {"role": ROLES[role], "content": _text_content(where, content or "")}
    for key in ("name", "tool_call_id", *_REASONING_KEYS):
        if message.get(key) is not None:
            out[key] = _string(f"{where}.{key}", message[key])
    if tool_calls:
        if role != "assistant":
            raise RecipeError(f"{where}.tool_calls is only allowed on assistant messages")
        if not isinstance(tool_calls, list):
            raise RecipeError(f"{where}.tool_calls must be a list")
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", call)
                             for j, call in enumerate(tool_calls)]
    out = _in_order_of(message, out)
    reasoning = next((out[key] for key in _REASONING_KEYS if key in out), None)
    if reasoning is not None:   # as transformers does: templates read one name or the other
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _in_order_of(original: dict, normalized: dict) -> dict:
    """`normalized` with keys in the client's order (templates may iterate or dump them)."""
    order = [key for key in original if key in normalized]
    order += [key for key in normalized if key not in original]
    return {key: normalized[key] for key in order}


def _text_content(where: str, content: Any) -> str:
    """A string, or a list of `{"type": "text", "text": ...}` parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecipeError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RecipeError(f"{where}.content[{j}] must be an object")
        if part.get("type") != "text":
            raise RecipeError(f"{where}.content[{j}] has type {_short(part.get('type'))}: "
                              "only text parts are supported (this model reads text only)")
        texts.append(_string(f"{where}.content[{j}].text", part.get("text")))
    return "\n".join(texts)


def _tool_call(where: str, call: Any) -> dict:
    if not isinstance(call, dict):
        raise RecipeError(f"{where} must be an object")
    if call.get("type", "function") != "function":
        raise RecipeError(f"{where}.type must be 'function'")
    function = call.get("function")
    if not isinstance(function, dict):
        raise RecipeError(f"{where}.function must be an object")
    out = {"type": "function"}
    if call.get("id") is not None:
        out["id"] = _string(f"{where}.id", call["id"])
    name = _string(f"{where}.function.name", function.get("name"))
    arguments = _arguments(f"{where}.function.arguments", function.get("arguments", "{}"))
    out["function"] = _in_order_of(function, {"name": name, "arguments": arguments})
    return _in_order_of(call, out)


def _arguments(where: str, arguments: Any) -> Any:
    """Arguments as a dict when they are a JSON object (templates expect one), else the string."""
    if isinstance(arguments, dict):
        return _json_value(where, arguments)
    arguments = _string(where, arguments)
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # nested past the parser's depth: keep the text
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def normalize_tools(tools: Any) -> list[dict] | None:
    """Validated copies of OpenAI-style tool definitions (`{"type": "function", ...}`)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RecipeError("tools must be a list")
    return [_tool(f"tools[{i}]", tool) for i, tool in enumerate(tools)]


def _tool(where: str, tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RecipeError(f"{where} must be an object with type 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RecipeError(f"{where}.function must be an object")
    _string(f"{where}.function.name", function.get("name"))
    if function.get("description") is not None:
        _string(f"{where}.function.description", function["description"])
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise RecipeError(f"{where}.function.parameters must be an object")
    return _in_order_of(tool, {"type": "function", **_json_value(where, tool)})


def _json_value(where: str, value: Any, depth: int = 0) -> Any:
    """A copy of a JSON value (str keys, JSON scalars), at most _MAX_JSON_DEPTH deep."""
    if depth > _MAX_JSON_DEPTH:
        raise RecipeError(f"{where} is nested too deeply")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise RecipeError(f"{where} has a non-string key")
        return {key: _json_value(f"{where}.{key}", item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_value(f"{where}[{i}]", item, depth + 1) for i, item in enumerate(value)]
    raise RecipeError(f"{where} must be JSON, got {type(value).__name__}")


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise RecipeError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Symbolic strings.

_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"   # private-use characters around a placeholder


class _UserText(str):
    """A user string in the symbolic render: renders as its placeholder, behaves as its text."""

    def __new__(cls, ledger: _Ledger, real: str):
        self = super().__new__(cls, ledger.placeholder(real))
        self._ledger, self._real = ledger, real
        return self

    def __len__(self):
        return len(self._real)

    def __bool__(self):
        return bool(self._real)

    def __hash__(self):
        return hash(self._real)

    def __eq__(self, other):
        return self._real == self._ledger.real(other) if isinstance(other, str) else NotImplemented

    def __ne__(self, other):
        return self._real != self._ledger.real(other) if isinstance(other, str) else NotImplemented

    def __lt__(self, other):
        return self._real < self._ledger.real(other)

    def __le__(self, other):
        return self._real <= self._ledger.real(other)

    def __gt__(self, other):
        return self._real > self._ledger.real(other)

    def __ge__(self, other):
        return self._real >= self._ledger.real(other)

    def __contains__(self, item):
        return self._ledger.real(item) in self._real

    def __iter__(self):
        return (self._ledger.wrap(char) for char in self._real)

    def __repr__(self):   # printing a list or dict of user text shows reprs
        return self._ledger.placeholder(repr(self._real))

    def __format__(self, spec):
        return self._ledger.placeholder(format(self._real, spec))

    def __html__(self):   # the `escape` filter
        return self._ledger.placeholder(str(markupsafe.escape(self._real)))

    def join(self, iterable):
        return self._ledger.wrap(self._real.join(self._ledger.real(item) for item in iterable))


def _lift(name: str):
    method = getattr(str, name)

    def lifted(self, *args, **kwargs):
        real = self._ledger.real
        result = method(self._real, *map(real, args), **{k: real(v) for k, v in kwargs.items()})
        return self._ledger.adopt(result)

    lifted.__name__ = name
    return lifted


for _name in ("__getitem__", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines",
              "partition", "rpartition", "replace", "upper", "lower", "title", "capitalize",
              "casefold", "swapcase", "center", "ljust", "rjust", "zfill", "expandtabs",
              "removeprefix", "removesuffix", "startswith", "endswith", "find", "rfind", "index",
              "rindex", "count", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
              "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle",
              "isupper"):
    setattr(_UserText, _name, _lift(_name))


_PLACEHOLDER = re.compile(_MARK_OPEN + r"(\d{8})\.(\d+)" + _MARK_CLOSE)
_JSON_ASCII_PLACEHOLDER = re.compile(r"\\ue000(\d{8})\.(\d+)\\ue001")   # ensure_ascii form


class _Ledger:
    """The placeholders of one symbolic render and the real text each stands for. A random
    nonce in every placeholder: lookalikes in template text are not taken for ours."""

    def __init__(self):
        self._nonce = f"{secrets.randbelow(10 ** 8):08d}"
        self._texts: list[str] = []

    def placeholder(self, real: str) -> str:
        self._texts.append(real)
        return f"{_MARK_OPEN}{self._nonce}.{len(self._texts) - 1}{_MARK_CLOSE}"

    def wrap(self, real: str) -> _UserText:
        return _UserText(self, real)

    def adopt(self, value: Any) -> Any:
        """A string method's result on user text: strings (also inside lists) stay user text."""
        if isinstance(value, str):
            return self.wrap(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self.adopt(item) for item in value)
        return value

    def real(self, value: Any) -> Any:
        """The real text behind a template value (placeholders inside plain strings resolved)."""
        if isinstance(value, _UserText):
            return value._real
        if isinstance(value, str) and _MARK_OPEN in value:
            return self.resolve(value).text
        if isinstance(value, tuple):
            return tuple(self.real(item) for item in value)
        return value

    def symbolize(self, value: Any, plain_keys: tuple = ()) -> Any:
        """User data for the symbolic render: every string becomes user text, except the values
        of `plain_keys` at this level (already validated against fixed values)."""
        if isinstance(value, str):
            return self.wrap(value)
        if isinstance(value, dict):
            return {(key if key in plain_keys else self.symbolize(key)):
                    (item if key in plain_keys else self.symbolize(item))
                    for key, item in value.items()}
        if isinstance(value, list):
            return [self.symbolize(item) for item in value]
        return value

    def json_ready(self, value: Any, sort_keys: bool) -> Any:
        """`value` with user text as bare placeholders, dicts pre-sorted by their real keys."""
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, dict):
            items = value.items()
            if sort_keys:
                items = sorted(items, key=lambda item: self.real(item[0]))
            return {self.json_ready(key, False): self.json_ready(item, sort_keys)
                    for key, item in items}
        if isinstance(value, (list, tuple)):
            return [self.json_ready(item, sort_keys) for item in value]
        return value

    def escape_json(self, text: str, ensure_ascii: bool) -> str:
        """Swap each placeholder inside JSON text for one standing for the JSON-escaped text."""
        pattern = _JSON_ASCII_PLACEHOLDER if ensure_ascii else _PLACEHOLDER

        def escaped(match: re.Match) -> str:
            if match[1] != self._nonce:
                return match[0]
            real = self._texts[int(match[2])]
            return self.placeholder(json.dumps(real, ensure_ascii=ensure_ascii)[1:-1])

        return pattern.sub(escaped, text)

    def resolve(self, rendered: str) -> Rendered:
        """The real text of a symbolic render, with the stretches the template wrote."""
        parts, spans, pos, start = [], [], 0, 0   # pos: in `rendered`; start: in the result
        for match in _PLACEHOLDER.finditer(rendered):
            if match[1] != self._nonce:
                continue
            parts.append(rendered[pos:match.start()])
            parts.append(self._texts[int(match[2])])
            if match.start() > pos:
                spans.append((start, start + match.start() - pos))
            start += match.start() - pos + len(parts[-1])
            pos = match.end()
        if pos < len(rendered):
            spans.append((start, start + len(rendered) - pos))
        parts.append(rendered[pos:])
        return Rendered("".join(parts), spans)


# ---------------------------------------------------------------------------------------------
# The sandbox: transformers' Jinja setup, plus a budget every loop, call and lookup pays into.

class _Budget:
    """What the current render may still spend; `ledger` is set for the symbolic render."""

    def __init__(self, limits: RenderLimits, ledger: _Ledger | None, deadline: float):
        self.limits, self.ledger, self.deadline = limits, ledger, deadline
        self.steps_left, self.built_left = limits.steps, limits.built
        self._measured: dict[int, tuple[Any, int]] = {}   # id → (value kept alive, size)

    def tick(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise RecipeError(f"chat template exceeded {self.limits.steps} steps")
        if time.monotonic() > self.deadline:
            raise RecipeError(f"chat template ran longer than {self.limits.seconds} s")

    def check_size(self, size: int) -> None:
        if size > self.limits.chars:
            raise RecipeError(f"chat template built a string over {self.limits.chars} chars")

    def check_args(self, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if type(value) is int and abs(value) > self.limits.int_arg:
                raise RecipeError(f"chat template passed {value} to a function "
                                  f"(limit {self.limits.int_arg})")

    def check_items(self, count: int) -> None:
        if count > self.limits.steps:
            raise RecipeError(f"chat template built a collection over {self.limits.steps} items")

    def measure(self, value: Any, nested: bool = False) -> int:
        """The size of `value` written out as text (what str() or tojson would produce): shared
        parts count every time they occur, so `[x, x]` nested 40 deep is refused long before
        printing it could take forever. Templates cannot mutate lists or dicts, so a size, once
        known, stays true; namespaces (mutable) may not be put inside other values."""
        if isinstance(value, str):
            return len(value) + 1
        if isinstance(value, Namespace):
            if nested:
                raise RecipeError("chat template put a namespace inside another value")
            return 1
        if not isinstance(value, (list, tuple, dict, set, frozenset)):
            return 1
        known = self._measured.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        parts = itertools.chain(value.keys(), value.values()) if isinstance(value, dict) else value
        size = 1 + sum(self.measure(part, nested=True) for part in parts)
        self._measured[id(value)] = (value, size)
        if size > self.limits.chars:
            raise RecipeError(f"chat template built a value over {self.limits.chars} chars long")
        return size

    def check_result(self, value: Any) -> Any:
        """A freshly built value: sized, and its size spent from the `built` budget (which
        bounds what a template can hold on to, e.g. by appending copies to a list)."""
        if isinstance(value, str):
            self.check_size(len(value))
        elif isinstance(value, (list, tuple, dict, set, frozenset)):
            self.check_items(len(value))
            self.measure(value)
        elif type(value) is int and value.bit_length() > 65536:
            raise RecipeError("chat template built an integer that is too large")
        else:
            return value
        self.built_left -= len(value)
        if self.built_left < 0:
            raise RecipeError(f"chat template built over {self.limits.built} chars and items")
        return value


_BUDGET: ContextVar[_Budget] = ContextVar("duplex_render_budget")
_WIDE_FORMAT = re.compile(r"\d{6,}|%[-+ #0]*\*|\{[^{}]*\{")   # huge widths, * widths, nesting


def _budget() -> _Budget:
    try:
        return _BUDGET.get()
    except LookupError:
        raise RecipeError("chat templates render only through Recipe") from None


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(str.__str__(fmt)):
        raise RecipeError("chat template used a format with a huge or indirect width")


def _check_growth(name: str, subject: Any, args: tuple, budget: _Budget) -> None:
    """Refuse string operations whose result would blow past the size limit before running."""
    if not isinstance(subject, str):
        return
    if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        budget.check_size(len(subject) + (len(subject) + 1) * len(args[1]))
    elif name == "indent":
        width = args[0] if args else 4
        width = len(width) if isinstance(width, str) else width if type(width) is int else 0
        budget.check_size(len(subject) + (subject.count("\n") + 1) * width)
    elif name == "expandtabs":
        width = args[0] if args and type(args[0]) is int else 8
        budget.check_size(len(subject) + subject.count("\t") * width)
    elif name == "format":
        _check_format(subject)


def _join_items(sep: Any, items: Any, budget: _Budget) -> Any:
    """The items of a join, listed if they come from an iterator, sized before joining."""
    if not isinstance(items, (str, list, tuple, dict, set)):
        items = list(itertools.islice(items, budget.limits.steps + 1))
    budget.check_items(len(items))
    if isinstance(sep, str):
        budget.check_size(len(items) * len(sep))
    return items


def _guard_filter(name: str, filter_fn):
    injected = getattr(filter_fn, "jinja_pass_arg", None) is not None  # env/context comes first

    @functools.wraps(filter_fn)
    def guarded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        values = args[1:] if injected else args
        budget.check_args(values[1:], kwargs)
        if values:
            _check_growth(name, values[0], values[1:], budget)
        if name == "join" and values:
            separator = values[1] if len(values) > 1 else kwargs.get("d", "")
            items = _join_items(separator, values[0], budget)
            args = (*args[:len(args) - len(values)], items, *values[1:])
        if name == "tojson":
            _check_indent(kwargs.get("indent", values[2] if len(values) > 2 else None))
        return budget.check_result(filter_fn(*args, **kwargs))

    return guarded


def _check_indent(indent: Any) -> None:
    width = len(indent) if isinstance(indent, str) else indent if type(indent) is int else 0
    if width > 16:
        raise RecipeError("chat template asked for a JSON indent over 16")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson; in the symbolic render user text inside comes out JSON-escaped."""
    ledger = _budget().ledger
    if ledger is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)
    text = json.dumps(ledger.json_ready(value, sort_keys), ensure_ascii=ensure_ascii,
                      indent=indent, separators=separators)
    return ledger.escape_json(text, ensure_ascii)


def _raise_exception(message):
    raise TemplateError(message)


def _dict(*args, **kwargs):
    return dict(*args, **kwargs)


class _Namespace(Namespace):
    """Jinja's namespace, refusing underscore names (as transformers does)."""

    def __init__(*args, **kwargs):  # noqa: N805 -- Jinja's signature, so `self=` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name, value)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name, value):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed")
        _budget().measure(value, nested=True)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with every step paid for and sized."""
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[loopcontrols, _GenerationTag])
        self.globals.pop("lipsum", None)
        self.globals.update(raise_exception=_raise_exception, dict=_dict, namespace=_Namespace)
        self.filters["tojson"] = _tojson
        for name, filter_fn in list(self.filters.items()):
            self.filters[name] = _guard_filter(name, filter_fn)

    def getattr(self, obj, attribute):
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        budget = _budget()
        budget.tick()
        value = super().getitem(obj, argument)
        return budget.check_result(value) if isinstance(argument, slice) else value

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} is not allowed")

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__)
        return wrapper

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- Jinja's convention
        budget = _budget()
        budget.tick()
        budget.check_args(args, kwargs)
        name, subject = getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None)
        _check_growth(name, subject, args, budget)
        if name == "join" and isinstance(subject, str) and args:
            args = (_join_items(subject, args[0], budget), *args[1:])
        return budget.check_result(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        budget.tick()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str) and type(count) is int:
                    budget.check_size(len(seq) * count)
                elif isinstance(seq, (list, tuple)) and type(count) is int:
                    budget.check_items(len(seq) * count)
        elif operator == "**" and type(left) is int and type(right) is int:
            if right > 4096 or left.bit_length() * max(right, 0) > 65536:
                raise RecipeError("chat template raised a number to a huge power")
        elif operator == "+" and isinstance(left, str) and isinstance(right, str):
            budget.check_size(len(left) + len(right))
        elif operator == "+" and isinstance(left, (list, tuple)) and hasattr(right, "__len__"):
            budget.check_items(len(left) + len(right))
        elif operator == "%":
            _check_format(left)
        return budget.check_result(super().call_binop(context, operator, left, right))

    def budget_iter(self, iterable):
        """Wraps every `{% for %}` iterable: each iteration is a step."""
        budget = _budget()
        for item in iterable:
            budget.tick()
            yield item

    def budget_slice(self, obj, start, stop, step):
        """Replaces `obj[a:b:c]`, which Jinja compiles to a plain subscript."""
        budget = _budget()
        budget.tick()
        return budget.check_result(obj[start:stop:step])

    def budget_container(self, value):
        """Wraps list, tuple and dict literals: their written-out size is measured."""
        budget = _budget()
        budget.tick()
        return budget.check_result(value)

    def concat(self, parts):
        """Joins block bodies (`{% set x %}`, macros, filter blocks); Jinja's is `"".join`."""
        parts = list(parts)
        budget = _budget()
        budget.tick()
        budget.check_size(sum(map(len, parts)))
        return budget.check_result("".join(parts))

    def budget_concat(self, items):
        """Replaces `~`: the joined size is checked before the join."""
        parts = [str(item) for item in items]
        budget = _budget()
        budget.tick()
        budget.check_size(sum(map(len, parts)))
        return budget.check_result("".join(parts))


@functools.lru_cache(maxsize=1)
def _sandbox() -> _Sandbox:
    return _Sandbox()


def _compile(source: str, max_chars: int):
    if not isinstance(source, str):
        raise RecipeError("a chat template must be a string")
    return _compile_cached(source, max_chars)


@functools.lru_cache(maxsize=64)
def _compile_cached(source: str, max_chars: int):
    if len(source) > max_chars:
        raise RecipeError(f"chat template is longer than {max_chars} chars")
    env = _sandbox()
    try:
        tree = env.parse(source)
        _add_budget_nodes(tree)
        return env.from_string(tree)
    except TemplateError as error:
        raise RecipeError(f"chat template does not compile: {error}") from None
    except (RecursionError, MemoryError, SyntaxError, ValueError) as error:
        raise RecipeError(f"chat template does not compile: {type(error).__name__}") from None


def _add_budget_nodes(node: nodes.Node) -> None:
    """Rewrite the template's syntax tree: loops iterate through `budget_iter`, `~` joins
    through `budget_concat`, slices go through `budget_slice`, list/tuple/dict literals through
    `budget_container`."""
    for field, value in node.iter_fields():
        if isinstance(value, nodes.Node):
            setattr(node, field, _budgeted(value))
        elif isinstance(value, list):
            setattr(node, field, [_budgeted(v) if isinstance(v, nodes.Node) else v
                                  for v in value])


def _budgeted(node: nodes.Node) -> nodes.Node:
    _add_budget_nodes(node)
    if isinstance(node, nodes.For):
        node.iter = _env_call("budget_iter", node.iter, node.lineno)
    elif isinstance(node, nodes.Concat):
        return _env_call("budget_concat", nodes.List(node.nodes, lineno=node.lineno), node.lineno)
    elif isinstance(node, (nodes.List, nodes.Dict)) or (isinstance(node, nodes.Tuple)
                                                         and node.ctx == "load"):
        return _env_call("budget_container", node, node.lineno)
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        bounds = [part or nodes.Const(None, lineno=node.lineno)
                  for part in (node.arg.start, node.arg.stop, node.arg.step)]
        return _env_call("budget_slice", node.node, node.lineno, *bounds)
    return node


def _env_call(name: str, arg: nodes.Expr, lineno: int, *more: nodes.Expr) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name, lineno=lineno), [arg, *more], [], None,
                      None, lineno=lineno)


def _render(template, context: dict, limits: RenderLimits, ledger: _Ledger | None,
            deadline: float) -> str:
    budget = _Budget(limits, ledger, deadline)
    token = _BUDGET.set(budget)
    try:
        chunks, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            budget.check_size(size)
            chunks.append(chunk)
        return "".join(chunks)
    except RecipeError:
        raise
    except TemplateError as error:
        raise RecipeError(f"chat template error: {_short(str(error))}") from None
    except Exception as error:  # a template is untrusted code: any failure is the request's
        raise RecipeError(f"chat template failed: {type(error).__name__}: "
                          f"{_short(str(error))}") from None
    finally:
        _BUDGET.reset(token)


def render_chat(template_source: str, messages: list[dict], tools: list[dict] | None,
                add_generation_prompt: bool, variables: dict,
                limits: RenderLimits = RenderLimits()) -> Rendered:
    """Render validated messages (see `normalize_messages`) with template-written stretches
    marked: the faithful text, labelled through the symbolic render (module docstring)."""
    template = _compile(template_source, limits.template_chars)
    deadline = time.monotonic() + limits.seconds   # for both renders together
    now = datetime.now()
    common = {**variables, "add_generation_prompt": add_generation_prompt, "documents": None,
              "strftime_now": now.strftime}
    faithful = _render(template, {**common, "messages": messages, "tools": tools}, limits, None,
                       deadline)
    ledger = _Ledger()
    symbolic_messages = [_symbolize_message(ledger, message) for message in messages]
    symbolic_tools = None if tools is None else [ledger.symbolize(t, ("type",)) for t in tools]
    symbolic = _render(template, {**common, "messages": symbolic_messages,
                                  "tools": symbolic_tools}, limits, ledger, deadline)
    rendered = ledger.resolve(symbolic)
    if rendered.text != faithful:
        raise RecipeError("the chat template transforms message text in a way the "
                          "injection-safe encoder cannot trace")
    return rendered


def _symbolize_message(ledger: _Ledger, message: dict) -> dict:
    out = ledger.symbolize({k: v for k, v in message.items() if k != "tool_calls"}, ("role",))
    if "tool_calls" in message:
        out["tool_calls"] = [ledger.symbolize(call, ("type",)) for call in message["tool_calls"]]
    return {key: out[key] for key in message}   # keep the key order of the faithful message


# ---------------------------------------------------------------------------------------------
# The recipe of one model.

class Recipe:
    """Everything between a model's text interface and its token ids (see module docstring)."""

    def __init__(self, tokenizer, model_path: str | None = None,
                 limits: RenderLimits = RenderLimits()):
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.limits = limits
        self.eos_token_ids = eos_token_ids(tokenizer, model_path)
        self.control_tokens = control_tokens(tokenizer)            # text → id
        self.control_token_ids = frozenset(self.control_tokens.values())
        longest_first = sorted(self.control_tokens, key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        added = tokenizer.added_tokens_decoder
        self._strips = {token_id: (added[token_id].lstrip, added[token_id].rstrip)
                        for token_id in self.control_token_ids if token_id in added}
        self._text = text_encoder(tokenizer)
        self._prompt_prefix = _added_prefix(tokenizer)
        self._variables = {key: value for key, value in tokenizer.special_tokens_map.items()}
        try:
            self.template: str | None = chat_template(tokenizer)
        except ValueError:
            self.template = None

    @classmethod
    def from_model(cls, model_path: str) -> Recipe:
        """The (cached) recipe of a local GGUF file or Hugging Face directory."""
        return _recipe_for(os.path.realpath(model_path))

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, template: str | None = None) -> Rendered:
        """The chat as text, with the stretches the template wrote (validates everything)."""
        source = self.template if template is None else template
        if source is None:
            raise RecipeError("the model has no chat template; pass `template`")
        return render_chat(source, normalize_messages(messages), normalize_tools(tools),
                           bool(add_generation_prompt), self._variables, self.limits)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, template: str | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """Token ids of a chat: control tokens only where the template wrote them.

        continue_final_message: the last message is the start of the assistant's reply
        (Anthropic's prefill, vLLM's `continue_final_message`): the history is rendered with
        the generation prompt and the reply's text follows as plain text (never a control
        token), so the model continues it instead of starting a new turn."""
        if continue_final_message:
            history, prefix = _split_final_assistant(messages)
            return (self.encode_chat(history, tools, True, template)
                    + self._text_ids(prefix, at_start=False))
        rendered = self.render_chat(messages, tools, add_generation_prompt, template)
        return self._encode_rendered(rendered)

    def count_chat_tokens(self, messages: list[dict], tools: list[dict] | None = None,
                          add_generation_prompt: bool = True, template: str | None = None) -> int:
        return len(self.encode_chat(messages, tools, add_generation_prompt, template))

    def encode_prompt(self, text: str) -> list[int]:
        """A plain completion prompt: no control tokens from the text; BOS only if the
        tokenizer adds one."""
        if not isinstance(text, str):
            raise RecipeError("prompt must be a string")
        return self._prompt_prefix + self._text_ids(text, at_start=True)

    def encode_reply_start(self, text: str) -> list[int]:
        """Ids of text the server writes at the start of the reply (a forced tool call's tag
        and header), as the model would write it, control tokens included. Never user text."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def new_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)

    def _encode_rendered(self, rendered: Rendered) -> list[int]:
        starts = [start for start, _ in rendered.template_spans]
        if any(not _inside(rendered.template_spans, starts, match.span())
               for match in self._control_re.finditer(rendered.text)):
            return self._encode_sections(rendered)   # user text holds a control token's text
        encoding = self.tokenizer(rendered.text, add_special_tokens=False,
                                  return_offsets_mapping=True)
        ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
        if all(_inside(rendered.template_spans, starts, offsets[i])
               for i, token_id in enumerate(ids) if token_id in self.control_token_ids):
            return list(ids)
        return self._encode_sections(rendered)

    def _encode_sections(self, rendered: Rendered) -> list[int]:
        """Cut at the template's control tokens; encode the text between with them off."""
        text, ids, pos = rendered.text, [], 0
        for start, end, token_id in self._template_controls(rendered):
            lstrip, rstrip = self._strips.get(token_id, (False, False))
            section = text[pos:start]
            ids += self._text_ids(section.rstrip() if lstrip else section, at_start=pos == 0)
            ids.append(token_id)
            pos = end
            while rstrip and pos < len(text) and text[pos].isspace():
                pos += 1
        return ids + self._text_ids(text[pos:], at_start=pos == 0)

    def _template_controls(self, rendered: Rendered):
        for start, end in rendered.template_spans:
            for match in self._control_re.finditer(rendered.text, start, end):
                yield match.start(), match.end(), self.control_tokens[match.group()]

    def _text_ids(self, text: str, at_start: bool) -> list[int]:
        """Plain-text ids; should merges ever build a control token, the text is split inside it."""
        if not text:
            return []
        encoding = self._text.encode(text, at_start)
        for i, token_id in enumerate(encoding.ids):
            if token_id in self.control_token_ids:
                start, end = encoding.offsets[i]
                if end - start < 2:
                    raise RecipeError(f"{text[start:end]!r} only encodes as a control token")
                middle = (start + end) // 2
                return (self._text_ids(text[:middle], at_start)
                        + self._text_ids(text[middle:], at_start=False))
        return list(encoding.ids)


def _split_final_assistant(messages: list[dict]) -> tuple[list[dict], str]:
    if not messages or messages[-1].get("role") != "assistant":
        raise RecipeError("continuing the final message needs a final assistant message")
    last = messages[-1]
    if last.get("tool_calls") or not isinstance(last.get("content"), str):
        raise RecipeError("the final assistant message to continue must be plain text")
    if len(messages) == 1:
        raise RecipeError("continuing the final message needs a message before it")
    return list(messages[:-1]), last["content"]


def _inside(spans: list[tuple[int, int]], starts: list[int], offset: tuple[int, int]) -> bool:
    k = bisect.bisect_right(starts, offset[0]) - 1
    return k >= 0 and offset[1] <= spans[k][1]


def _added_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before plain text (BOS for Llama-style tokenizers)."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    for k in range(len(with_special) - len(without) + 1):
        if with_special[k:k + len(without)] == without:
            return list(with_special[:k])
    return []


@functools.lru_cache(maxsize=8)
def _recipe_for(model_path: str) -> Recipe:
    return Recipe(load_tokenizer(model_path), model_path=model_path)

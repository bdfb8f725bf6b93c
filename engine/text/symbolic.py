"""Symbolic user text: the placeholders that tell template text from user text.

Owns: the ledger of one symbolic render (engine/text/recipe.py explains the two renders).
A `_UserText` is a str whose characters are a unique placeholder but whose methods and
comparisons act on the real text; `Ledger.resolve` puts the real text back and returns the
stretches the template itself wrote.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any, NamedTuple

import markupsafe


class Rendered(NamedTuple):
    """A rendered chat: its text and the (start, end) stretches the template itself wrote."""
    text: str
    template_spans: list[tuple[int, int]]



_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"   # private-use characters around a placeholder


class _UserText(str):
    """A user string in the symbolic render: renders as its placeholder, behaves as its text."""

    def __new__(cls, ledger: Ledger, real: str):
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


class Ledger:
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

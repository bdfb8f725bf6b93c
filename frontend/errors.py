"""Client-facing errors: one exception type, rendered in the shape of the API that was called.

Handlers raise `ApiError(kind, message, param=...)`; the server's middleware renders it as
OpenAI (`{"error": {message, type, param, code}}`) or Anthropic
(`{"type": "error", "error": {type, message}}`) JSON, and the WebSocket turns it into an
error frame. `kind` is the one word for what went wrong; each API maps it to its own HTTP
status and error type (overload is 429 for OpenAI, 529 for Anthropic).
"""
from __future__ import annotations

import re
from typing import NamedTuple

import msgspec

RETRY_AFTER_S = 1


class _Shape(NamedTuple):
    openai_status: int
    openai_type: str
    anthropic_status: int
    anthropic_type: str


_SHAPES: dict[str, _Shape] = {
    "invalid_request": _Shape(400, "invalid_request_error", 400, "invalid_request_error"),
    "authentication": _Shape(401, "authentication_error", 401, "authentication_error"),
    "not_found": _Shape(404, "not_found_error", 404, "not_found_error"),
    "method_not_allowed": _Shape(405, "invalid_request_error", 405, "invalid_request_error"),
    "too_large": _Shape(413, "invalid_request_error", 413, "request_too_large"),
    "overloaded": _Shape(429, "rate_limit_error", 529, "overloaded_error"),
    "unavailable": _Shape(503, "service_unavailable", 503, "overloaded_error"),
    "timeout": _Shape(504, "timeout_error", 504, "timeout_error"),
    "internal": _Shape(500, "server_error", 500, "api_error"),
}

# Kinds a client may retry after a pause; their responses carry Retry-After.
_RETRYABLE = frozenset({"overloaded", "unavailable"})

# HTTP statuses aiohttp raises itself (unknown route, body too large, ...) -> our kinds.
_KIND_BY_STATUS = {400: "invalid_request", 401: "authentication", 404: "not_found",
                   405: "method_not_allowed", 413: "too_large", 429: "overloaded",
                   503: "unavailable", 504: "timeout"}


class ApiError(Exception):
    """A request the server refuses or cannot finish, with the field at fault when known."""

    def __init__(self, kind: str, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        assert kind in _SHAPES, f"unknown error kind {kind!r}"
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_status(cls, status: int, message: str) -> "ApiError":
        return cls(_KIND_BY_STATUS.get(status, "internal" if status >= 500 else "invalid_request"),
                   message)

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.kind in _RETRYABLE else {}

    def openai_status(self) -> int:
        return _SHAPES[self.kind].openai_status

    def anthropic_status(self) -> int:
        return _SHAPES[self.kind].anthropic_status

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": _SHAPES[self.kind].openai_type,
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error",
                "error": {"type": _SHAPES[self.kind].anthropic_type, "message": self.message}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param, code=code)


def from_validation(err: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """A msgspec decode failure -> 400 naming the field, e.g. `messages[0].role`."""
    if not isinstance(err, msgspec.ValidationError):  # (ValidationError is a DecodeError)
        return invalid(f"request body is not valid JSON: {err}")
    text, _, where = str(err).partition(" - at `$")
    path = where.rstrip("`").lstrip(".")
    missing = re.search(r"missing required field `([^`]+)`", text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return invalid(f"{text} at '{path}'" if path else text, param=path or None)


def from_sampling_error(err: ValueError) -> ApiError:
    """SamplingParams raises `SamplingParams.<field> <rule>`; name the field for the client."""
    text = str(err)
    param = None
    if text.startswith("SamplingParams."):
        param = text.removeprefix("SamplingParams.").split(" ", 1)[0]
        text = text.removeprefix("SamplingParams.")
    return invalid(text, param=param)

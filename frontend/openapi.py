"""/openapi.json, generated from the msgspec request and response types in `protocol`.

Streaming endpoints document their SSE payloads: each `data:` line is one object of the
named schema (chat.completion.chunk, text_completion, or an Anthropic stream event).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import msgspec

from duplex.frontend import protocol as p

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"


class _Endpoint(NamedTuple):
    method: str
    path: str
    summary: str
    request: Any  # a msgspec type, or None
    response: Any
    stream: Any = None  # type of each SSE data payload, when it can stream
    style: str = "openai"  # error shape


_ANTHROPIC_EVENT = (p.MessageStart | p.ContentBlockStart | p.ContentBlockDelta
                    | p.ContentBlockStop | p.MessageDelta | p.MessageStop | p.Ping
                    | p.AnthropicError)

ENDPOINTS = (
    _Endpoint("post", "/v1/chat/completions", "Create a chat completion (OpenAI)",
              p.ChatCompletionRequest, p.ChatCompletion, p.ChatCompletionChunk),
    _Endpoint("post", "/v1/completions", "Create a text completion (OpenAI)",
              p.CompletionRequest, p.Completion, p.Completion),
    _Endpoint("get", "/v1/models", "List the served model", None, p.ModelList),
    _Endpoint("post", "/v1/messages", "Create a message (Anthropic)", p.MessagesRequest,
              p.AnthropicResponse, _ANTHROPIC_EVENT, "anthropic"),
    _Endpoint("post", "/v1/messages/count_tokens", "Count a message's input tokens (Anthropic)",
              p.CountTokensRequest, p.CountTokensResponse, style="anthropic"),
    _Endpoint("post", "/tokenize", "Tokenize a prompt or chat messages", p.TokenizeRequest,
              p.TokenizeResponse),
)


@functools.cache
def spec() -> dict:
    types = [t for e in ENDPOINTS for t in (e.request, e.response, e.stream) if t is not None]
    types += [p.OpenAIError, p.AnthropicError, p.WsClientFrame, p.WsServerFrame]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    by_type = dict(zip(types, schemas))
    paths: dict[str, dict] = {}
    for e in ENDPOINTS:
        paths.setdefault(e.path, {})[e.method] = _operation(e, by_type)
    paths["/v1/ws"] = {"get": {
        "summary": "WebSocket chat: JSON text frames, many requests per socket by id",
        "responses": {"101": {"description": "switching protocols"}},
        "x-client-frames": by_type[p.WsClientFrame], "x-server-frames": by_type[p.WsServerFrame]}}
    for path, summary in (("/health", "200 when a worker is ready, else 503"),
                          ("/v1/status", "Engine status for the web UI"),
                          ("/metrics", "Prometheus metrics")):
        paths[path] = {"get": {"summary": summary, "responses": {"200": {"description": "ok"}}}}
    return {"openapi": OPENAPI_VERSION,
            "info": {"title": "Duplex", "version": "0.1.0",
                     "description": "OpenAI- and Anthropic-compatible LLM serving API"},
            "paths": paths, "components": {"schemas": components, "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
            "security": [{}, {"bearer": []}, {"x-api-key": []}]}


def _operation(e: _Endpoint, by_type: dict) -> dict:
    ok: dict = {"application/json": {"schema": by_type[e.response]}}
    if e.stream is not None:
        ok["text/event-stream"] = {"schema": by_type[e.stream]}
    error = {"application/json": {"schema": by_type[p.OpenAIError if e.style == "openai"
                                                    else p.AnthropicError]}}
    op: dict = {"summary": e.summary,
                "responses": {"200": {"description": "success", "content": ok},
                              "4XX": {"description": "bad request", "content": error},
                              "5XX": {"description": "server unavailable", "content": error}}}
    if e.request is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": by_type[e.request]}}}
    return op


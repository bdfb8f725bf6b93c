"""The wire formats the outside sees: request bodies, responses, SSE framing, WebSocket frames.

Every body is decoded with msgspec into these strict structs (no coercion: `"5"` is not an
int), so a wrong type, a missing field or an unknown role becomes a 400 naming the field.
Unknown fields are ignored, as the official SDKs send fields we do not use. Responses are
encoded from the structs here too, so `/openapi.json` and the WebSocket JSON Schema are
generated from the same types the server speaks.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from aiohttp import web

from duplex.frontend.body_limits import TooDeep, check_depth
from duplex.frontend.errors import from_validation, invalid
from duplex.frontend.offload import CPU_POOL

# Integers that travel to the worker must fit msgpack's 64 bits; the rules are checked later.
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
_KW = dict(kw_only=True)


# ================================================================ shared request pieces
class SamplingFields(msgspec.Struct, **_KW):
    """Sampling fields every generation API accepts (OpenAI names, vLLM extensions)."""
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculate: bool = True  # Duplex: false turns speculative decoding off for this request
    retention: Literal["chat", "agent"] | None = None  # None: header, else tools decide
    cache_salt: str | None = None


# ================================================================ OpenAI requests
class ContentPart(msgspec.Struct, **_KW):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, **_KW):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, **_KW):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, **_KW):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # an earlier turn's thinking sent back (vLLM's name, and OpenRouter's `reasoning`)
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(msgspec.Struct, **_KW):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, **_KW):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, **_KW):
    name: str


class NamedToolChoice(msgspec.Struct, **_KW):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(msgspec.Struct, **_KW):
    include_usage: bool = False


class JsonSchemaSpec(msgspec.Struct, **_KW):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, **_KW):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(msgspec.Struct, **_KW):
    """vLLM's `structured_outputs`: exactly one of these."""
    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class StructuredFields(SamplingFields, **_KW):
    """Output constraints (frontend/structured.py) and logit_bias, OpenAI and vLLM names."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(StructuredFields, **_KW):
    messages: list[ChatMessage]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: Int | None = None
    n: Int = 1
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the final assistant message
    chat_template_kwargs: dict[str, Any] | None = None  # variables the chat template reads
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking_budget: Int | None = None  # tokens of thinking before the engine closes it


class CompletionRequest(StructuredFields, **_KW):
    prompt: str | list[str | TokenId | list[TokenId]]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    echo: bool = False
    logprobs: Int | None = None
    suffix: str | None = None
    best_of: Int | None = None


class TokenizeRequest(msgspec.Struct, **_KW):
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True


# ================================================================ OpenAI responses
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class DraftStats(msgspec.Struct):
    """Duplex extension: speculative draft tokens proposed / accepted (per streamed chunk,
    or totals when inside `usage`)."""
    draft_proposed: int = 0
    draft_accepted: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class CompletionUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    duplex: DraftStats | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprobInfo]


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # the thinking block (a reasoning parser is on)


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    object: Literal["chat.completion"] = "chat.completion"


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    duplex: DraftStats | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    """Both the whole response and, streamed, each chunk (as the OpenAI API does)."""
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    duplex: DraftStats | None = None
    object: Literal["text_completion"] = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "duplex"
    max_model_len: int | None = None
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int


class OpenAIErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    error: OpenAIErrorBody


# ================================================================ Anthropic requests / responses
_BLOCK = dict(kw_only=True, tag_field="type")


class TextBlock(msgspec.Struct, tag="text", **_BLOCK):
    text: str


class ToolUseBlock(msgspec.Struct, tag="tool_use", **_BLOCK):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", **_BLOCK):
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", **_BLOCK):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", **_BLOCK):
    data: str


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class AnthropicMessage(msgspec.Struct, **_KW):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(msgspec.Struct, **_KW):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None


class AnthropicToolChoice(msgspec.Struct, **_KW):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(msgspec.Struct, **_KW):
    messages: list[AnthropicMessage]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest, **_KW):
    max_tokens: Int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    ignore_eos: bool = False
    speculate: bool = True  # Duplex: false turns speculative decoding off for this request
    retention: Literal["chat", "agent"] | None = None  # None: header, else tools decide
    cache_salt: str | None = None
    # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}: the thinking block
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # Duplex: variables the template reads
    # {"format": {"type": "json_schema", "schema": {...}}}: structured output (effort: unused)
    output_config: dict[str, Any] | None = None


class AnthropicUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class AnthropicResponse(msgspec.Struct):
    id: str
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


_EVENT = dict(tag_field="type")


class MessageStart(msgspec.Struct, tag="message_start", **_EVENT):
    message: AnthropicResponse


class ContentBlockStart(msgspec.Struct, tag="content_block_start", **_EVENT):
    index: int
    content_block: ThinkingBlock | TextBlock | ToolUseBlock


class TextDelta(msgspec.Struct, tag="text_delta", **_EVENT):
    text: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", **_EVENT):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", **_EVENT):
    thinking: str


class SignatureDelta(msgspec.Struct, tag="signature_delta", **_EVENT):
    signature: str


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", **_EVENT):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", **_EVENT):
    index: int


class StopInfo(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag="message_delta", **_EVENT):
    delta: StopInfo
    usage: AnthropicUsage


class MessageStop(msgspec.Struct, tag="message_stop", **_EVENT):
    pass


class Ping(msgspec.Struct, tag="ping", **_EVENT):
    pass


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag="error", **_EVENT):
    error: AnthropicErrorBody


# ================================================================ WebSocket frames
class WsChat(SamplingFields, tag="chat", tag_field="type", **_KW):
    """Client -> server: start a chat request; `id` is the client's name for it."""
    id: str
    messages: list[ChatMessage]
    model: str | None = None  # None: the served model; another name is an error frame
    chat_template_kwargs: dict[str, Any] | None = None  # variables the chat template reads
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking_budget: Int | None = None  # tokens of thinking before the engine closes it


class WsCancel(msgspec.Struct, tag="cancel", tag_field="type", **_KW):
    id: str


class WsPing(msgspec.Struct, tag="ping", tag_field="type", **_KW):
    pass


class WsDelta(msgspec.Struct, tag="delta", tag_field="type"):
    id: str
    text: str
    num_tokens: int
    draft_proposed: int = 0
    draft_accepted: int = 0
    accepted_mask: list[bool] = []
    reasoning: str = ""  # thinking text (a reasoning parser is on); `text` is the answer


class WsUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    reasoning_tokens: int = 0  # of completion_tokens, those inside the thinking block


class WsTimings(msgspec.Struct):
    ttft_s: float
    tokens_per_s: float
    e2e_s: float


class WsDone(msgspec.Struct, tag="done", tag_field="type"):
    id: str
    finish_reason: str
    usage: WsUsage
    timings: WsTimings
    batch_invariant: bool


class WsError(msgspec.Struct, tag="error", tag_field="type"):
    id: str | None
    code: str
    message: str


class WsPong(msgspec.Struct, tag="pong", tag_field="type"):
    pass


WsClientFrame = WsChat | WsCancel | WsPing
WsServerFrame = WsDelta | WsDone | WsError | WsPong


def ws_json_schema() -> dict:
    """JSON Schema of every WebSocket frame, both directions, under `$defs`."""
    (client, server), defs = msgspec.json.schema_components(
        [WsClientFrame, WsServerFrame], ref_template="#/$defs/{name}")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "Duplex WebSocket protocol (/v1/ws)",
            "properties": {"client": client, "server": server}, "$defs": defs}


# ================================================================ decoding and framing
T = TypeVar("T")
_encoder = msgspec.json.Encoder()

# The id the server gives each HTTP request (logs, X-Request-Id, response ids).
REQ_ID = web.RequestKey("req_id", str)


def decode_json(raw: bytes | str, kind: type[T]) -> T:
    """Bytes from a client -> a struct, or an ApiError (400) naming the bad field. Nothing
    in `raw` can make it raise anything else (a body too deep is refused before parsing).
    Bytes are decoded as they are (msgspec checks the UTF-8), without a copy as text."""
    if not raw or raw.isspace():
        raise invalid("request body is empty; expected a JSON object")
    try:
        check_depth(raw)
        return msgspec.json.decode(raw, type=kind)
    except TooDeep as e:
        raise invalid(f"request body: {e}", code="json_too_deep") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None
    except (RecursionError, MemoryError, ValueError, TypeError) as e:  # never a 5xx
        raise invalid(f"request body cannot be decoded: {type(e).__name__}") from None


async def read_json(request: web.Request, kind: type[T]) -> T:
    """Read and decode a request body; an oversized body raises aiohttp's 413 first, and a
    large one is decoded off the event loop (frontend.offload)."""
    pool = request.app.get(CPU_POOL)
    if pool is None:
        return decode_json(await request.read(), kind)
    raw = await pool.read_body(request)
    return await pool.run(len(raw), decode_json, raw, kind)


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=encode(obj), status=status, headers=headers,
                        content_type="application/json")


class SseStream:
    """An open `text/event-stream` response. `send` raises ConnectionResetError once the
    client has gone, which the caller treats as a disconnect (its request is aborted)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str]) -> "SseStream":
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **headers})
        await response.prepare(request)
        return cls(response)

    async def send(self, data: Any, event: str | None = None) -> None:
        payload = data if isinstance(data, bytes) else encode(data)
        head = b"event: " + event.encode() + b"\n" if event else b""
        await self._response.write(head + b"data: " + payload + b"\n\n")

    async def close(self) -> web.StreamResponse:
        try:
            await self._response.write_eof()
        except ConnectionResetError:
            pass
        return self._response

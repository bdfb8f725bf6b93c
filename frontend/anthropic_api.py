"""Anthropic-compatible HTTP API: POST /v1/messages and /v1/messages/count_tokens.

Anthropic messages (system, text / tool_use / tool_result blocks) are converted to the
normalized chat, and the request to an `Order` for the intake (frontend/intake.py); the
pipeline's events become content blocks, or the
SSE sequence message_start, ping, (content_block_start, content_block_delta*,
content_block_stop)*, message_delta, message_stop; a failed request ends with one `error`
event instead. With a reasoning parser on, the thinking block comes first as a `thinking`
content block (`thinking_delta` events); `thinking: {type: enabled, budget_tokens}` is the
thinking budget, and `thinking` blocks sent back in history are the turn's reasoning. As in
Anthropic's API, `input_tokens` counts the prompt tokens not read from the cache and
`cache_read_input_tokens` those that were (zero included), the same counts in a stream's
message_start (sent with the first output) as in its message_delta. `output_config.format` (a JSON
schema) constrains the answer as OpenAI's `response_format` does (frontend/structured.py).
A tool call cut by max_tokens is left out of a whole message (stop_reason "max_tokens"); a
stream, which has started its tool_use block, closes it and ends with "max_tokens".
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from typing import TYPE_CHECKING, AsyncIterator

from aiohttp import web

from duplex.engine.messages import FinishReason
from duplex.engine.text import messages as normalized
from duplex.engine.text.messages import Chat
from duplex.engine.text.tool_parser import (ToolCallArgsDelta, ToolCallEnd, ToolCallStart,
                                            without_cut_call)
from duplex.frontend import structured
from duplex.frontend.errors import invalid
from duplex.frontend.generation import ChoiceResult, Delta, Event, Usage, collect
from duplex.frontend.intake import ChatPrompt, Order
from duplex.frontend.offload import body_size
from duplex.frontend.protocol import (AnthropicMessage, AnthropicResponse, AnthropicTool,
                                      AnthropicUsage, ContentBlockDelta, ContentBlockStart,
                                      ContentBlockStop, CountTokensRequest, CountTokensResponse,
                                      InputJsonDelta, MessageDelta, MessagesRequest,
                                      MessageStart, MessageStop, Ping, RedactedThinkingBlock,
                                      SseStream, StopInfo, TextBlock, TextDelta, ThinkingBlock,
                                      ThinkingDelta, ToolResultBlock, ToolUseBlock, REQ_ID,
                                      json_response, read_json)

if TYPE_CHECKING:
    from duplex.frontend.app_state import AppState

log = logging.getLogger("duplex.anthropic")

# Anthropic stop_reason of each finish reason (a stop string is "stop_sequence")
_STOP_REASONS = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens",
                 FinishReason.TOOL_CALLS: "tool_use"}


class AnthropicApi:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.intake = state.intake

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages),
                web.post("/v1/messages/count_tokens", self.count_tokens)]

    async def messages(self, request: web.Request) -> web.StreamResponse:
        with self.intake.admit() as ticket:
            body = await read_json(request, MessagesRequest)
            started = await self.intake.start(ticket, request, body_size(request), self._order,
                                              request, body)
            msg_id = f"msg_{request[REQ_ID]}"
            async with contextlib.aclosing(started.events) as events:
                if body.stream:
                    return await _stream(request, msg_id, self.state.model_name, events)
                [result] = await collect(events, 1)
            if result.final.failed:
                raise result.final.api_error()
            return json_response(_response(msg_id, self.state.model_name, result))

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await read_json(request, CountTokensRequest)
        ids = await self.intake.prompt_ids(body_size(request), self._order, request, body)
        return json_response(CountTokensResponse(len(ids)))

    def _order(self, request: web.Request, body: CountTokensRequest) -> Order:
        """The intake's order of a request (count_tokens: its prompt part)."""
        tools = tuple(tool_dict(t) for t in body.tools or [])
        messages = chat_messages(body)
        prefill = bool(body.messages) and body.messages[-1].role == "assistant"
        content = messages[-1]["content"] if prefill else ""
        if content != content.rstrip():
            raise invalid("final assistant content cannot end with trailing whitespace",
                          param=f"messages[{len(body.messages) - 1}].content")
        _check_tool_choice(body.tool_choice, tools, prefill)
        thinking = getattr(body, "thinking", None)
        disabled = thinking is not None and thinking.get("type") == "disabled"
        prompt = ChatPrompt(Chat(messages, list(tools) or None), continue_final_message=prefill,
                            template_kwargs=getattr(body, "chat_template_kwargs", None),
                            effort="none" if disabled else None)
        order = Order(req_id=f"msg_{request[REQ_ID]}", model=body.model, prompt=prompt,
                      sampling={}, tools=tools, tool_choice=_tool_choice_name(body.tool_choice),
                      parallel_tool_calls=_parallel(body.tool_choice), prefill_tool_call=True)
        return _with_generation(order, body) if isinstance(body, MessagesRequest) else order


def _with_generation(order: Order, body: MessagesRequest) -> Order:
    """The order of /v1/messages: count_tokens' plus what generation needs."""
    sampling = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    stop=body.stop_sequences, ignore_eos=body.ignore_eos,
                    speculate=body.speculate)
    return dataclasses.replace(
        order, sampling=sampling, max_tokens=body.max_tokens,
        output_format=structured.from_anthropic(body.output_config),
        thinking_budget=_thinking_budget(body.thinking), thinking_param="thinking.budget_tokens",
        retention=body.retention, cache_salt=body.cache_salt)


def _check_tool_choice(choice, tools: tuple[dict, ...], prefill: bool) -> None:
    """tool_choice any / tool: the named tool exists, and no assistant prefill beside it."""
    if not tools or choice is None or choice.type not in ("any", "tool"):
        return
    names = [t["function"]["name"] for t in tools]
    if choice.type == "tool" and choice.name not in names:
        raise invalid(f"tool_choice names {choice.name!r}, which is not in tools",
                      param="tool_choice")
    if prefill:
        raise invalid("an assistant prefill cannot be combined with tool_choice "
                      f"{choice.type!r}", param="tool_choice")


# ================================================================ request conversion
def chat_messages(body: CountTokensRequest) -> list[dict]:
    """Anthropic system + messages -> normalized messages (engine/text/messages.py), straight
    from the decoded structs (tool results become tool turns)."""
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(
            block.text for block in body.system)
        out.append(normalized.message("system", system))
    for i, message in enumerate(body.messages):
        out += _convert(message, f"messages[{i}]")
    return out


def _convert(message: AnthropicMessage, where: str) -> list[dict]:
    if isinstance(message.content, str):
        return [normalized.message(message.role, message.content)]
    texts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock) and message.role == "assistant":
            thoughts.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock) and message.role == "assistant":
            continue  # encrypted elsewhere: nothing a template could render
        elif isinstance(block, ToolUseBlock) and message.role == "assistant":
            calls.append(normalized.tool_call(block.name, block.input, block.id))
        elif isinstance(block, ToolResultBlock) and message.role == "user":
            results.append(normalized.message("tool", _tool_result_text(block),
                                              tool_call_id=block.tool_use_id))
        else:
            raise invalid(f"{where}.content[{j}]: a {message.role} message cannot hold a "
                          f"{type(block).__name__} block", param=f"{where}.content[{j}].type")
    text = "\n".join(texts)
    if message.role == "assistant":
        return [normalized.message("assistant", text, tool_calls=calls,
                                   reasoning="\n".join(thoughts) if thoughts else None)]
    return results + ([normalized.message("user", text)] if texts or not results else [])


def _tool_result_text(block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    return "\n".join(part.text for part in block.content)


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a tool call (`toolu_...`) from the parser's (`call_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def _tool_choice_name(choice) -> str | None:
    """Anthropic tool_choice as structured.for_chat takes it (auto when absent)."""
    if choice is None:
        return "auto"
    return {"any": "required", "tool": choice.name}.get(choice.type, choice.type)


def _parallel(choice) -> bool:
    return not (choice is not None and choice.disable_parallel_tool_use)


def _thinking_budget(thinking: dict | None) -> int | None:
    """The budget of `thinking: {type: enabled, budget_tokens: N}` (None: not enabled)."""
    if thinking is None or thinking.get("type") == "disabled":
        return None
    if thinking.get("type") != "enabled":
        raise invalid(f"thinking.type must be 'enabled' or 'disabled', got "
                      f"{thinking.get('type')!r}", param="thinking.type")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise invalid("thinking.budget_tokens must be an integer", param="thinking.budget_tokens")
    return budget


def tool_dict(tool: AnthropicTool) -> dict:
    """An Anthropic tool -> a normalized tool."""
    function: dict = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return normalized.tool(function)


# ================================================================ response formatting
def _usage(usage: Usage) -> AnthropicUsage:
    return AnthropicUsage(input_tokens=usage.prompt_tokens - usage.cached_tokens,
                          output_tokens=usage.completion_tokens,
                          cache_read_input_tokens=usage.cached_tokens,
                          cache_creation_input_tokens=0)


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        log.warning("tool call arguments are not JSON: %.200r", arguments)
        return {}
    return value if isinstance(value, dict) else {"value": value}


def _response(msg_id: str, model: str, result: ChoiceResult) -> AnthropicResponse:
    final = result.final
    calls = without_cut_call(list(result.tool_calls.values()),
                             final.finish_reason == FinishReason.LENGTH)
    content: list = [ThinkingBlock(thinking=result.reasoning)] if result.reasoning else []
    if result.text or not (calls or result.reasoning):
        content.append(TextBlock(text=result.text))
    content += [ToolUseBlock(id=tool_use_id(c.id), name=c.name, input=_tool_input(c.arguments))
                for c in calls]
    return AnthropicResponse(msg_id, model, content, _stop_reason(final),
                             final.stop_sequence, _usage(final.usage))


def _stop_reason(final) -> str:
    if final.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(final.finish_reason, "end_turn")


class _Blocks:
    """Numbers the content blocks of a streamed message: a text block opens on first text
    and closes when a tool call starts; each tool call is a block of its own."""

    def __init__(self, sse: SseStream) -> None:
        self.sse = sse
        self.num_blocks = 0
        self.num_events = 0  # pipeline events seen: the first one starts the message
        self.open_text: int | None = None
        self.open_thinking: int | None = None
        self.tool_blocks: dict[int, int] = {}  # tool call index -> block index

    async def thinking(self, text: str) -> None:
        if self.open_thinking is None:
            self.open_thinking = await self._start(ThinkingBlock(thinking=""))
        await self._send(ContentBlockDelta(self.open_thinking, ThinkingDelta(text)))

    async def close_thinking(self) -> None:
        if self.open_thinking is not None:
            await self._send(ContentBlockStop(self.open_thinking))
            self.open_thinking = None

    async def text(self, text: str) -> None:
        await self.close_thinking()
        if self.open_text is None:
            self.open_text = await self._start(TextBlock(text=""))
        await self._send(ContentBlockDelta(self.open_text, TextDelta(text)))

    async def tool_event(self, event) -> None:
        if isinstance(event, ToolCallStart):
            await self.close_thinking()
            await self.close_text()
            self.tool_blocks[event.index] = await self._start(
                ToolUseBlock(id=tool_use_id(event.id), name=event.name, input={}))
        elif isinstance(event, ToolCallArgsDelta):
            await self._send(ContentBlockDelta(self.tool_blocks[event.index],
                                               InputJsonDelta(event.json_text)))
        elif isinstance(event, ToolCallEnd):
            await self._send(ContentBlockStop(self.tool_blocks.pop(event.index)))

    async def close_all(self) -> None:
        await self.close_thinking()
        await self.close_text()
        for index in sorted(self.tool_blocks.values()):
            await self._send(ContentBlockStop(index))
        self.tool_blocks.clear()

    async def close_text(self) -> None:
        if self.open_text is not None:
            await self._send(ContentBlockStop(self.open_text))
            self.open_text = None

    async def _start(self, block) -> int:
        index, self.num_blocks = self.num_blocks, self.num_blocks + 1
        await self._send(ContentBlockStart(index, block))
        return index

    async def _send(self, event) -> None:
        await self.sse.send(event, event=event.__struct_config__.tag)


async def _stream(request: web.Request, msg_id: str, model: str,
                  events: AsyncIterator[Event]) -> web.StreamResponse:
    """message_start goes out with the first event, whose usage already counts the prompt's
    cached tokens: it and message_delta report the one usage (`_usage`)."""
    sse = await SseStream.open(request, {"X-Request-Id": request[REQ_ID]})
    blocks = _Blocks(sse)
    with contextlib.suppress(ConnectionResetError):  # client gone: the caller aborts
        async for event in events:
            if blocks.num_events == 0:
                await _start(sse, msg_id, model, event.usage)
            blocks.num_events += 1
            if isinstance(event, Delta):
                if event.reasoning:
                    await blocks.thinking(event.reasoning)
                if event.text:
                    await blocks.text(event.text)
                for tool_event in event.tool_events:
                    await blocks.tool_event(tool_event)
            elif event.failed:
                await sse.send(event.api_error().anthropic_body(), event="error")
            else:
                if blocks.num_blocks == 0:  # an empty answer is still one text block
                    await blocks.text("")
                await blocks.close_all()
                await sse.send(MessageDelta(StopInfo(_stop_reason(event), event.stop_sequence),
                                            _usage(event.usage)), event="message_delta")
                await sse.send(MessageStop(), event="message_stop")
    return await sse.close()


async def _start(sse: SseStream, msg_id: str, model: str, usage: Usage) -> None:
    await sse.send(MessageStart(AnthropicResponse(msg_id, model, [], None, None, _usage(usage))),
                   event="message_start")
    await sse.send(Ping(), event="ping")

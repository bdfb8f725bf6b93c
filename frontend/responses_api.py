"""OpenAI Responses API: POST /v1/responses (streamed or not), GET /v1/responses/{id}.

Owns the conversion between Responses items and the chat pipeline, and a bounded store of
finished responses (the conversation they close) so `previous_response_id` continues one:
the earlier turns render to the same token prefix, so the KV prefix cache serves them
instead of recomputing. Structured output (`text.format`) and tools go through the same
constraint machinery as chat completions (frontend/structured.py). With a reasoning parser
on, the thinking block is a `reasoning` output item (`reasoning_text` content, streamed as
response.reasoning_text.delta) before the message; `reasoning.effort` is a thinking budget,
and reasoning items sent back in `input` are the next assistant turn's reasoning. What the
pipeline cannot do (background runs, built-in tools) is a 400 naming the field. The
request becomes an `Order` for the intake (frontend/intake.py) like every API's: rendered
off the loop when big, retention from x-duplex-retention or `retention` (agent with tools),
`cache_salt` as in chat completions.

Cut by max_output_tokens, a response is `incomplete` (incomplete_details.reason
max_output_tokens), a stream ends with `response.incomplete` instead of
`response.completed`, and the item the cut fell in says `incomplete`; a function call cut
inside its arguments is left out of a whole response (a stream has announced it: there its
item ends `incomplete`) and is never stored as a turn.
"""
from __future__ import annotations

import collections
import contextlib
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from aiohttp import web

from duplex.engine.messages import FinishReason
from duplex.engine.text.errors import RecipeError
from duplex.engine.text.messages import Chat
from duplex.engine.text.tool_parser import (ToolCallArgsDelta, ToolCallStart, is_whole_json,
                                            without_cut_call)
from duplex.frontend import structured
from duplex.frontend.errors import ApiError, invalid
from duplex.frontend.generation import EFFORT_BUDGETS, Delta, collect
from duplex.frontend.intake import ChatPrompt, Order
from duplex.frontend.offload import body_size
from duplex.frontend.protocol import REQ_ID, SseStream, json_response, read_json

if TYPE_CHECKING:
    from duplex.frontend.app_state import AppState

MAX_STORED = 1024  # finished responses kept for previous_response_id (LRU)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # Duplex: variables the template reads
    retention: Literal["chat", "agent"] | None = None  # Duplex; None: header, else tools decide
    cache_salt: str | None = None  # Duplex: splits the KV cache further


class ResponsesApi:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.intake = state.intake
        self.store: collections.OrderedDict[str, tuple[list[dict], dict]] = \
            collections.OrderedDict()

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.create),
                web.get("/v1/responses/{response_id}", self.retrieve)]

    async def retrieve(self, request: web.Request) -> web.Response:
        entry = self.store.get(request.match_info["response_id"])
        if entry is None:
            raise ApiError("not_found", "no stored response with that id",
                           param="response_id")
        return json_response(entry[1])

    async def create(self, request: web.Request) -> web.StreamResponse:
        with self.intake.admit() as ticket:
            body = await read_json(request, ResponsesRequest)
            started = await self.intake.start(ticket, request, body_size(request), self._order,
                                              request, body)
            messages = started.order.prompt.chat.messages  # the conversation it continues
            reply = _Reply(f"resp_{request[REQ_ID]}", self.state.model_name, body)
            async with contextlib.aclosing(started.events) as events:
                if body.stream:
                    return await self._stream(request, reply, events, messages)
                [result] = await collect(events, 1)
            if result.final.failed:
                raise result.final.api_error()
            reply.add_result(result.text, list(result.tool_calls.values()), result.final,
                             result.reasoning)
            return json_response(self._finish(reply, messages, body))

    # ------------------------------------------------------------ request -> order
    def _messages(self, body: ResponsesRequest) -> list[dict]:
        history: list[dict] = []
        if body.previous_response_id is not None:
            entry = self.store.get(body.previous_response_id)
            if entry is None:
                raise invalid(f"previous_response_id {body.previous_response_id!r} is not a "
                              "stored response (expired, or stored with store: false)",
                              param="previous_response_id")
            history = [m for m in entry[0] if m["role"] != "system"]
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        return system + history + _input_messages(body.input)

    def _order(self, request: web.Request, body: ResponsesRequest) -> Order:
        _refuse_unsupported(body)
        tools = tuple(_chat_tool(t, i) for i, t in enumerate(body.tools or []))
        effort = _effort(body.reasoning, self.state.reasoning is not None)
        prompt = ChatPrompt(_chat(self._messages(body), list(tools) or None),
                            template_kwargs=body.chat_template_kwargs, effort=effort)
        return Order(req_id=f"resp_{request[REQ_ID]}", model=body.model, prompt=prompt,
                     sampling=dict(temperature=body.temperature, top_p=body.top_p),
                     max_tokens=body.max_output_tokens, max_tokens_param="max_output_tokens",
                     output_format=_text_format(body.text), tools=tools,
                     tool_choice=_tool_choice(body.tool_choice, list(tools) or None),
                     parallel_tool_calls=body.parallel_tool_calls, reasoning_effort=effort,
                     retention=body.retention, cache_salt=body.cache_salt)

    def _finish(self, reply: _Reply, messages: list[dict], body: ResponsesRequest) -> dict:
        response = reply.response("completed")
        if body.store:
            turn = {"role": "assistant", "content": reply.text}
            if reply.reasoning:
                turn["reasoning_content"] = reply.reasoning
            calls = [c for c in reply.calls if reply.call_status(c) == "completed"]
            if calls:
                turn["tool_calls"] = [{"id": c["call_id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
            self.store[reply.id] = ([*messages, turn], response)
            while len(self.store) > MAX_STORED:
                self.store.popitem(last=False)
        return response

    # ------------------------------------------------------------ streaming
    async def _stream(self, request, reply: _Reply, events, messages) -> web.StreamResponse:
        sse = await SseStream.open(request, {"X-Request-Id": request[REQ_ID]})
        emit = _Emitter(sse)
        with contextlib.suppress(ConnectionResetError):
            await emit("response.created", response=reply.response("in_progress"))
            await emit("response.in_progress", response=reply.response("in_progress"))
            text_index = None
            async for event in events:
                if isinstance(event, Delta):
                    if event.reasoning:
                        await _reasoning_delta(emit, reply, event.reasoning)
                    if event.text or event.tool_events:
                        await _close_reasoning(emit, reply)
                    if event.text:
                        if text_index is None:
                            text_index = await _open_text(emit, reply)
                        reply.text += event.text
                        await emit("response.output_text.delta", item_id=reply.msg_id,
                                   output_index=text_index, content_index=0,
                                   delta=event.text, logprobs=[])
                    for tool_event in event.tool_events:
                        await _tool_event(emit, reply, tool_event)
                    continue
                if event.failed:
                    await emit("error", code=event.finish_reason, message=event.error,
                               param=None)
                    break
                reply.final = event
                await _close_reasoning(emit, reply)
                if text_index is not None:
                    await _close_text(emit, reply, text_index)
                for call in reply.calls:
                    await _close_call(emit, reply, call)
                terminal = "response.incomplete" if reply.is_incomplete else "response.completed"
                await emit(terminal, response=self._finish(reply, messages, reply.body))
        return await sse.close()


# ================================================================ conversion helpers
def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise invalid("background responses are not supported", param="background")


def _effort(reasoning: dict | None, has_thinking: bool) -> str | None:
    """`reasoning.effort` (a thinking budget: generation.EFFORT_BUDGETS), checked."""
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise invalid(f"reasoning.effort must be one of {', '.join(EFFORT_BUDGETS)}, got "
                      f"{effort!r}", param="reasoning.effort")
    if not has_thinking:
        if effort == "none":
            return None
        raise invalid("reasoning.effort: this model has no thinking block (the server runs "
                      "no reasoning parser)", param="reasoning.effort")
    return effort


def _chat(messages: list[dict], tools: list[dict] | None) -> Chat:
    """Input items are untyped dicts (and stored turns): validated here, once."""
    try:
        return Chat.from_dicts(messages, tools)
    except RecipeError as e:
        raise invalid(str(e), param="input") from None


def _input_messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: list[str] = []  # reasoning items: the next assistant turn's
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant",
                              param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), where)})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
            continue
        elif kind == "function_call":
            out.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": item.get("call_id", ""), "type": "function", "function": {
                    "name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                        "content": _content_text(item.get("output"), where)})
        else:
            raise invalid(f"{where}.type {kind!r} is not supported (message, reasoning, "
                          "function_call, function_call_output are)", param=f"{where}.type")
        if reasoning and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = "\n".join(reasoning)
        reasoning = [] if out[-1]["role"] == "assistant" else reasoning
    if not out:
        raise invalid("input is empty", param="input")
    return out


def _reasoning_text(item: dict, where: str) -> str:
    """The text of a reasoning input item: its reasoning_text content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise invalid(f"{where}.content must be a list of reasoning_text parts",
                      param=f"{where}.content")
    return "\n".join(p["text"] for p in parts)


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                    "input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]: only text parts are supported",
                              param=f"{where}.content[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"{where}.content must be a string or a list of text parts",
                  param=f"{where}.content")


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise invalid(f"tools[{i}]: only function tools are supported", param=f"tools[{i}]")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or
                {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice, tools) -> str | None:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid("tool_choice must be none, auto, required or a function",
                          param="tool_choice")
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or name not in \
            {t["function"]["name"] for t in tools or []}:
        raise invalid("tool_choice must name one of the function tools", param="tool_choice")
    return name


def _text_format(text: dict | None) -> structured.Requested | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None

    class _Format:  # the chat completions shape, for structured.from_openai's rules
        def __init__(self, fmt):
            self.type = fmt.get("type")
            self.json_schema = _Schema(fmt) if self.type == "json_schema" else None

    class _Schema:
        def __init__(self, fmt):
            self.schema_ = fmt.get("schema")

    if fmt.get("type") not in ("json_object", "json_schema"):
        raise invalid("text.format.type must be text, json_object or json_schema",
                      param="text.format")
    requested = structured._response_format(_Format(fmt))
    return requested._replace(param="text.format") if requested else None


# ================================================================ response objects
class _Reply:
    def __init__(self, reply_id: str, model: str, body: ResponsesRequest) -> None:
        self.id, self.model, self.body = reply_id, model, body
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = ""
        self.reasoning = ""
        self.rs_id = "rs_" + uuid.uuid4().hex
        self.reasoning_open = False  # streaming: the reasoning item is open
        self.calls: list[dict] = []
        self.final = None

    @property
    def num_reasoning_items(self) -> int:
        return 1 if self.reasoning else 0

    def add_result(self, text: str, calls, final, reasoning: str = "") -> None:
        """A whole response: a call cut by max_output_tokens is left out."""
        self.text = text
        self.reasoning = reasoning
        self.calls = [{"call_id": c.id, "name": c.name, "arguments": c.arguments,
                       "id": "fc_" + uuid.uuid4().hex}
                      for c in without_cut_call(calls, final.finish_reason == FinishReason.LENGTH)]
        self.final = final

    @property
    def is_incomplete(self) -> bool:
        """The output was cut by max_output_tokens."""
        return self.final is not None and self.final.finish_reason == FinishReason.LENGTH

    # an item is incomplete when the cut fell inside it: the last one of a cut output
    def reasoning_status(self) -> str:
        return "incomplete" if self.is_incomplete and not (self.text or self.calls) \
            else "completed"

    def message_status(self) -> str:
        return "incomplete" if self.is_incomplete and not self.calls else "completed"

    def call_status(self, call: dict) -> str:
        return "incomplete" if self.is_incomplete and not is_whole_json(call["arguments"]) \
            else "completed"

    def output(self) -> list[dict]:
        out = [_reasoning_item(self.rs_id, self.reasoning, self.reasoning_status())] \
            if self.reasoning else []
        if self.text or not self.calls:
            out.append(_message_item(self.msg_id, self.text, self.message_status()))
        out += [_call_item(c, self.call_status(c)) for c in self.calls]
        return out

    def response(self, status: str) -> dict:
        body = self.body
        response = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.output() if self.final is not None else [],
            "instructions": body.instructions, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "metadata": body.metadata or {},
            "text": body.text or {"format": {"type": "text"}}, "error": None,
            "incomplete_details": None, "store": body.store}
        final = self.final
        if final is not None:
            usage = final.usage
            response["usage"] = {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}
            if final.finish_reason == FinishReason.LENGTH:
                response["status"] = "incomplete"
                response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status != \
        "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


async def _reasoning_delta(emit: _Emitter, reply: _Reply, text: str) -> None:
    if not reply.reasoning_open:
        reply.reasoning_open = True
        await emit("response.output_item.added", output_index=0,
                   item=_reasoning_item(reply.rs_id, "", "in_progress"))
        await emit("response.content_part.added", item_id=reply.rs_id, output_index=0,
                   content_index=0, part={"type": "reasoning_text", "text": ""})
    reply.reasoning += text
    await emit("response.reasoning_text.delta", item_id=reply.rs_id, output_index=0,
               content_index=0, delta=text)


async def _close_reasoning(emit: _Emitter, reply: _Reply) -> None:
    if not reply.reasoning_open:
        return
    reply.reasoning_open = False
    await emit("response.reasoning_text.done", item_id=reply.rs_id, output_index=0,
               content_index=0, text=reply.reasoning)
    await emit("response.content_part.done", item_id=reply.rs_id, output_index=0,
               content_index=0, part={"type": "reasoning_text", "text": reply.reasoning})
    await emit("response.output_item.done", output_index=0,
               item=_reasoning_item(reply.rs_id, reply.reasoning, reply.reasoning_status()))


def _call_item(call: dict, status: str) -> dict:
    return {"type": "function_call", "id": call["id"], "call_id": call["call_id"],
            "name": call["name"], "arguments": call["arguments"], "status": status}


class _Emitter:
    """Sends typed events with increasing sequence numbers."""

    def __init__(self, sse: SseStream) -> None:
        self.sse, self.sequence = sse, 0

    async def __call__(self, kind: str, **fields) -> None:
        await self.sse.send(json.dumps({"type": kind, "sequence_number": self.sequence,
                                        **fields}).encode(), event=kind)
        self.sequence += 1


async def _open_text(emit: _Emitter, reply: _Reply) -> int:
    index = len(reply.calls) + reply.num_reasoning_items
    await emit("response.output_item.added", output_index=index,
               item=_message_item(reply.msg_id, "", "in_progress"))
    await emit("response.content_part.added", item_id=reply.msg_id, output_index=index,
               content_index=0, part={"type": "output_text", "text": "", "annotations": []})
    return index


async def _close_text(emit: _Emitter, reply: _Reply, index: int) -> None:
    part = {"type": "output_text", "text": reply.text, "annotations": []}
    await emit("response.output_text.done", item_id=reply.msg_id, output_index=index,
               content_index=0, text=reply.text, logprobs=[])
    await emit("response.content_part.done", item_id=reply.msg_id, output_index=index,
               content_index=0, part=part)
    await emit("response.output_item.done", output_index=index,
               item=_message_item(reply.msg_id, reply.text, reply.message_status()))


async def _tool_event(emit: _Emitter, reply: _Reply, event) -> None:
    if isinstance(event, ToolCallStart):
        call = {"call_id": event.id, "name": event.name, "arguments": "",
                "id": "fc_" + uuid.uuid4().hex, "output_index": len(reply.calls) +
                (1 if reply.text else 0) + reply.num_reasoning_items}
        reply.calls.append(call)
        await emit("response.output_item.added", output_index=call["output_index"],
                   item=_call_item(call, "in_progress"))
    elif isinstance(event, ToolCallArgsDelta):
        call = reply.calls[event.index]
        call["arguments"] += event.json_text
        await emit("response.function_call_arguments.delta", item_id=call["id"],
                   output_index=call["output_index"], delta=event.json_text)


async def _close_call(emit: _Emitter, reply: _Reply, call: dict) -> None:
    await emit("response.function_call_arguments.done", item_id=call["id"],
               output_index=call["output_index"], arguments=call["arguments"])
    await emit("response.output_item.done", output_index=call["output_index"],
               item=_call_item(call, reply.call_status(call)))

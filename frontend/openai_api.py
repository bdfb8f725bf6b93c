"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, /tokenize.

Each handler decodes the body (protocol structs), turns it into an `Order` for the intake
(frontend/intake.py: render, tokenize, constraints, retention, admission, submit) and
formats the pipeline's events as `chat.completion` / `text_completion` objects or SSE
chunks ending with `data: [DONE]`. Usage always carries `prompt_tokens_details.cached_tokens`.
A choice that fails mid-stream becomes one `{"error": ...}` chunk, then `[DONE]`.
Tool calls: `content` is null beside them; a call cut by max_tokens is left out of a whole
completion (finish_reason "length"), while a stream, which has sent its start, ends it with
finish_reason "length" (engine/text/tool_parser.py: never markup in the content).
A completion prompt is the caller's whole text: its control tokens' text parses as those
tokens; a chat's messages never do (frontend/intake.py).
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, AsyncIterator

from aiohttp import web

from duplex.engine.messages import FinishReason
from duplex.engine.text.messages import Chat
from duplex.engine.text.tool_parser import ToolCallArgsDelta, ToolCallStart, without_cut_call
from duplex.frontend import structured
from duplex.frontend.errors import invalid
from duplex.frontend.generation import (ChoiceResult, Delta, Event, Final, TokenInfo, collect,
                                        sampling_fields, total_usage)
from duplex.frontend.intake import ChatPrompt, Order, Prompt
from duplex.frontend.offload import body_size
from duplex.frontend.openai_messages import chat_messages, tool_dict  # noqa: F401 - API names
from duplex.frontend.protocol import (AssistantMessage, ChatChoice, ChatCompletion,
                                      ChatCompletionChunk, ChatCompletionRequest,
                                      ChoiceLogprobs, ChunkChoice, ChunkDelta, Completion,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionTokensDetails, CompletionUsage, DeltaFunction,
                                      DeltaToolCall, DraftStats, FunctionCall, ModelCard,
                                      ModelList, NamedToolChoice, PromptTokensDetails,
                                      SseStream, TokenizeRequest, TokenizeResponse,
                                      TokenLogprobInfo, ToolCall, TopLogprob, REQ_ID,
                                      json_response, read_json)

if TYPE_CHECKING:
    from duplex.frontend.app_state import AppState

MAX_PROMPTS = 32  # prompts in one /v1/completions request


class OpenAIApi:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.intake = state.intake

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model_id}", self.model),
                web.post("/tokenize", self.tokenize)]

    # ------------------------------------------------------------ chat
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        with self.intake.admit() as ticket:
            body = await read_json(request, ChatCompletionRequest)
            started = await self.intake.start(ticket, request,
                                              body_size(request, body.chat_template),
                                              self._chat_order, request, body)
            reply = _Reply(f"chatcmpl-{request[REQ_ID]}", self.state.model_name, body.n)
            async with contextlib.aclosing(started.events) as events:
                if body.stream:
                    include_usage = bool(body.stream_options and body.stream_options.include_usage)
                    return await _stream_chat(request, reply, events, include_usage)
                results = await collect(events, body.n)
            return json_response(_chat_completion(reply, results))

    def _chat_order(self, request: web.Request, body: ChatCompletionRequest) -> Order:
        tools = tuple(tool_dict(t) for t in body.tools) if body.tools else ()
        _check_tool_choice(body)
        choice = _tool_choice_name(body.tool_choice)
        if body.continue_final_message and tools and choice not in ("none", "auto") \
                and self.state.options.tool_call_parser == "hermes":
            raise invalid("continue_final_message cannot be combined with a required or "
                          "named tool_choice", param="tool_choice")
        prompt = ChatPrompt(Chat(chat_messages(body.messages), list(tools) or None),
                            body.add_generation_prompt, body.chat_template,
                            body.continue_final_message, body.chat_template_kwargs,
                            body.reasoning_effort)
        requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                            if body.max_completion_tokens is not None
                            else (body.max_tokens, "max_tokens"))
        return Order(
            req_id=f"chatcmpl-{request[REQ_ID]}", model=body.model, prompt=prompt,
            sampling=sampling_fields(body, _chat_logprobs_count(body)), max_tokens=requested,
            max_tokens_param=param, n=body.n, output_format=structured.from_openai(body),
            logit_bias=body.logit_bias, tools=tools, tool_choice=choice,
            parallel_tool_calls=body.parallel_tool_calls, prefill_tool_call=True,
            thinking_budget=body.thinking_budget, reasoning_effort=body.reasoning_effort,
            retention=body.retention, cache_salt=body.cache_salt)

    # ------------------------------------------------------------ completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self.intake.admit() as ticket:
            body = await read_json(request, CompletionRequest)
            started = await self.intake.start(ticket, request, body_size(request),
                                              self._completion_order, request, body)
            prompts = started.prompts
            reply = _Reply(f"cmpl-{request[REQ_ID]}", self.state.model_name,
                           len(prompts) * body.n)
            echoes = [prompts[i // body.n].text if body.echo else ""
                      for i in range(reply.num_choices)]
            async with contextlib.aclosing(started.events) as events:
                if body.stream:
                    include_usage = bool(body.stream_options and body.stream_options.include_usage)
                    return await _stream_completion(request, reply, events, include_usage,
                                                    echoes, body.n)
                results = await collect(events, reply.num_choices)
            return json_response(self._completion(reply, body, results, prompts, echoes))

    def _completion_order(self, request: web.Request, body: CompletionRequest) -> Order:
        if body.suffix is not None:
            raise invalid("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid("best_of is not supported (only best_of == n)", param="best_of")
        prompts = _split_prompts(body.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        return Order(req_id=f"cmpl-{request[REQ_ID]}", model=body.model, prompt=prompts,
                     sampling=sampling_fields(body, body.logprobs), max_tokens=body.max_tokens,
                     default_max_tokens=16, n=body.n, output_format=structured.from_openai(body),
                     logit_bias=body.logit_bias, retention=body.retention,
                     cache_salt=body.cache_salt, echo=body.echo)

    def _completion(self, reply: _Reply, body: CompletionRequest, results: list[ChoiceResult],
                    prompts: list[Prompt], echoes: list[str]) -> Completion:
        finals = _finals_or_raise(results)
        choices = []
        for r in results:
            logprobs = None
            if body.logprobs is not None:
                echoed = ([self.state.pipeline.token_text(t)
                           for t in prompts[r.index // body.n].token_ids] if body.echo else [])
                logprobs = _completion_logprobs(r.logprobs, echoed)
            choices.append(CompletionChoice(r.index, echoes[r.index] + r.text,
                                            r.final.finish_reason, logprobs))
        return Completion(reply.id, reply.created, reply.model, choices,
                          usage=usage_struct(finals, body.n))

    # ------------------------------------------------------------ models, tokenize
    async def models(self, _: web.Request) -> web.Response:
        state = self.state
        names = state.options.served_model_names or (state.model_name,)
        info = state.engine.ready_info
        cards = [ModelCard(name, state.started, max_model_len=info.max_model_len if info else None)
                 for name in names]
        return json_response(ModelList(cards))

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the card of a served model, or a 404 in OpenAI's shape."""
        model_id = request.match_info["model_id"]
        self.state.check_model(model_id)
        info = self.state.engine.ready_info
        return json_response(ModelCard(model_id, self.state.started,
                                       max_model_len=info.max_model_len if info else None))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request, TokenizeRequest)
        ids = await self.intake.prompt_ids(body_size(request), _tokenize_order, body)
        return json_response(TokenizeResponse(ids, len(ids)))


def _tokenize_order(body: TokenizeRequest) -> Order:
    """/tokenize: the prompt ids a chat or a completion prompt would get."""
    if (body.messages is None) == (body.prompt is None):
        raise invalid("give exactly one of 'messages' or 'prompt'", param="messages")
    if body.prompt is not None:
        prompt: ChatPrompt | list = [body.prompt]
    else:
        tools = [tool_dict(t) for t in body.tools] if body.tools else None
        prompt = ChatPrompt(Chat(chat_messages(body.messages), tools), body.add_generation_prompt)
    return Order(req_id="tokenize", model=None, prompt=prompt, sampling={})


# ================================================================ request conversion
def _check_tool_choice(body: ChatCompletionRequest) -> None:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        if choice == "required" and not body.tools:
            raise invalid("tool_choice 'required' needs tools", param="tool_choice")
        return
    names = {t.function.name for t in body.tools or []}
    if choice.function.name not in names:
        raise invalid(f"tool_choice names {choice.function.name!r}, which is not in tools",
                      param="tool_choice")


def _tool_choice_name(choice) -> str | None:
    """tool_choice as structured.tool_calls takes it: none / auto / required / a name."""
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return choice or "auto"


def _chat_logprobs_count(body: ChatCompletionRequest) -> int | None:
    if not body.logprobs:
        if body.top_logprobs:
            raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return body.top_logprobs or 0


def _split_prompts(prompt) -> list[str | list[int]]:
    """The four prompt forms -> a list of prompts, each text or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) and p for p in prompt):
        return list(prompt)
    raise invalid("prompt must be a string, a list of strings, a list of token ids or a "
                  "list of non-empty token-id lists", param="prompt")


# ================================================================ response formatting
class _Reply:
    """Fields every object of one response shares."""

    def __init__(self, reply_id: str, model: str, num_choices: int) -> None:
        self.id = reply_id
        self.model = model
        self.num_choices = num_choices
        self.created = int(time.time())


def usage_struct(finals: list[Final], n: int = 1) -> CompletionUsage:
    """Usage of the whole request, with Duplex's speculation totals under `duplex`."""
    usage = total_usage(finals, n)
    drafts = DraftStats(sum(f.num_draft_proposed for f in finals),
                        sum(f.num_draft_accepted for f in finals))
    return CompletionUsage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
                           PromptTokensDetails(usage.cached_tokens), drafts,
                           CompletionTokensDetails(usage.reasoning_tokens))


def _finals_or_raise(results: list[ChoiceResult]) -> list[Final]:
    finals = [r.final for r in results]
    for final in finals:
        if final.failed:
            raise final.api_error()
    return finals


def _chat_completion(reply: _Reply, results: list[ChoiceResult]) -> ChatCompletion:
    finals = _finals_or_raise(results)
    choices = []
    for r in results:
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in without_cut_call(list(r.tool_calls.values()),
                                           r.final.finish_reason == FinishReason.LENGTH)]
        content = r.text if r.text or not calls else None
        logprobs = _chat_logprobs(r.logprobs) if r.logprobs else None
        message = AssistantMessage(content, tool_calls=calls or None,
                                   reasoning_content=r.reasoning or None)
        choices.append(ChatChoice(r.index, message,
                                  r.final.finish_reason, logprobs))
    return ChatCompletion(reply.id, reply.created, reply.model, choices,
                          usage_struct(finals, reply.num_choices))


def _chat_logprobs(infos: list[TokenInfo]) -> ChoiceLogprobs:
    return ChoiceLogprobs([
        TokenLogprobInfo(t.text, t.logprob, list(t.text.encode()),
                         [TopLogprob(text, lp, list(text.encode())) for text, lp in t.top])
        for t in infos])


def _completion_logprobs(infos: list[TokenInfo], echoed: list[str],
                         offset: int = 0) -> CompletionLogprobs:
    tokens = list(echoed) + [t.text for t in infos]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[None] * len(echoed) + [t.logprob for t in infos],
        top_logprobs=[None] * len(echoed) + [dict(t.top) or None for t in infos],
        text_offset=offsets)


def _delta_tool_calls(events: list) -> list[DeltaToolCall] | None:
    calls = []
    for e in events:
        if isinstance(e, ToolCallStart):
            calls.append(DeltaToolCall(e.index, id=e.id, type="function",
                                       function=DeltaFunction(name=e.name, arguments="")))
        elif isinstance(e, ToolCallArgsDelta):
            calls.append(DeltaToolCall(e.index, function=DeltaFunction(arguments=e.json_text)))
    return calls or None


async def _stream_chat(request: web.Request, reply: _Reply, events: AsyncIterator[Event],
                       include_usage: bool) -> web.StreamResponse:
    def chunk(choices, usage=None, duplex=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(reply.id, reply.created, reply.model, choices, usage, duplex)

    sse = await SseStream.open(request, {"X-Request-Id": request[REQ_ID]})
    with contextlib.suppress(ConnectionResetError):  # client gone: the caller aborts
        await sse.send(chunk([ChunkChoice(i, ChunkDelta(role="assistant", content=""))
                              for i in range(reply.num_choices)]))
        finals = []
        async for event in events:
            if isinstance(event, Delta):
                if event.text or event.reasoning or event.tool_events or event.logprobs:
                    delta = ChunkDelta(content=event.text or None,
                                       tool_calls=_delta_tool_calls(event.tool_events),
                                       reasoning_content=event.reasoning or None)
                    logprobs = _chat_logprobs(event.logprobs) if event.logprobs else None
                    await sse.send(chunk([ChunkChoice(event.index, delta, None, logprobs)],
                                         duplex=_draft_stats(event)))
            elif event.failed:
                await sse.send(event.api_error().openai_body())
                break
            else:
                finals.append(event)
                await sse.send(chunk([ChunkChoice(event.index, ChunkDelta(),
                                                  event.finish_reason)]))
        else:
            if include_usage:
                await sse.send(chunk([], usage=usage_struct(finals, reply.num_choices)))
        await sse.send(b"[DONE]")
    return await sse.close()


async def _stream_completion(request: web.Request, reply: _Reply, events: AsyncIterator[Event],
                             include_usage: bool, echoes: list[str], n: int
                             ) -> web.StreamResponse:
    def chunk(choices, usage=None, duplex=None) -> Completion:
        return Completion(reply.id, reply.created, reply.model, choices, usage, duplex)

    sse = await SseStream.open(request, {"X-Request-Id": request[REQ_ID]})
    with contextlib.suppress(ConnectionResetError):  # client gone: the caller aborts
        for i, echo in enumerate(echoes):
            if echo:
                await sse.send(chunk([CompletionChoice(i, echo, None)]))
        finals = []
        async for event in events:
            if isinstance(event, Delta):
                if event.text or event.logprobs:
                    logprobs = _completion_logprobs(event.logprobs, []) if event.logprobs else None
                    await sse.send(chunk([CompletionChoice(event.index, event.text, None,
                                                           logprobs)], duplex=_draft_stats(event)))
            elif event.failed:
                await sse.send(event.api_error().openai_body())
                break
            else:
                finals.append(event)
                await sse.send(chunk([CompletionChoice(event.index, "", event.finish_reason)]))
        else:
            if include_usage:
                await sse.send(chunk([], usage=usage_struct(finals, n)))
        await sse.send(b"[DONE]")
    return await sse.close()


def _draft_stats(delta: Delta) -> DraftStats:
    return DraftStats(delta.num_draft_proposed, delta.num_draft_accepted)

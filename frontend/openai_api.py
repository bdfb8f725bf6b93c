"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, /tokenize.

Each handler validates the body (protocol structs), tokenizes (recipe), builds a `Job` and
formats the pipeline's events as `chat.completion` / `text_completion` objects or SSE
chunks ending with `data: [DONE]`. Usage always carries `prompt_tokens_details.cached_tokens`.
A choice that fails mid-stream becomes one `{"error": ...}` chunk, then `[DONE]`.
Tool calls: `content` is null beside them; a call cut by max_tokens is left out of a whole
completion (finish_reason "length"), while a stream, which has sent its start, ends it with
finish_reason "length" (engine/text/tool_parser.py: never markup in the content).
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, AsyncIterator, NamedTuple

import msgspec
from aiohttp import web

from duplex.engine.messages import FinishReason
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text import messages as normalized
from duplex.engine.text.messages import Chat
from duplex.engine.text.tool_formats import tool_format
from duplex.engine.text.tool_parser import ToolCallArgsDelta, ToolCallStart, without_cut_call
from duplex.frontend import structured
from duplex.frontend.errors import invalid
from duplex.frontend.retention import request_retention
from duplex.frontend.offload import body_size
from duplex.frontend.generation import (ChoiceResult, Delta, Event, Final, Job, TokenInfo,
                                 check_n, collect, params_from_fields, resolve_max_tokens,
                                 template_kwargs, thinking_budget, thinking_variables,
                                 total_usage)
from duplex.frontend.protocol import (AssistantMessage, ChatChoice, ChatCompletion,
                               ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
                               ChoiceLogprobs, ChunkChoice, ChunkDelta, Completion,
                               CompletionChoice, CompletionLogprobs, CompletionRequest,
                               CompletionTokensDetails, CompletionUsage, DeltaFunction,
                               DeltaToolCall, DraftStats,
                               FunctionCall, ModelCard, ModelList, NamedToolChoice,
                               PromptTokensDetails,
                               SseStream, TokenizeRequest, TokenizeResponse, TokenLogprobInfo,
                               Tool, ToolCall, TopLogprob, REQ_ID, json_response, read_json)
from duplex.frontend.responses_api import ResponsesApi

if TYPE_CHECKING:
    from duplex.frontend.server import AppState

MAX_PROMPTS = 32  # prompts in one /v1/completions request


class OpenAIApi:
    def __init__(self, state: AppState) -> None:
        self.state = state

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model_id}", self.model),
                web.post("/tokenize", self.tokenize),
                *ResponsesApi(self.state).routes()]

    # ------------------------------------------------------------ chat
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        with self.state.admit():
            body = await read_json(request, ChatCompletionRequest)
            job, param = await self.state.cpu.run(body_size(request, body.chat_template),
                                                  self._chat_job, request, body)
            await structured.check(job.params.constraint, param)
            reply = _Reply(f"chatcmpl-{request[REQ_ID]}", self.state.model_name, body.n)
            async with contextlib.aclosing(self.state.pipeline.run(job)) as events:
                if body.stream:
                    include_usage = bool(body.stream_options and body.stream_options.include_usage)
                    return await _stream_chat(request, reply, events, include_usage)
                results = await collect(events, job.n)
            return json_response(_chat_completion(reply, results))

    def _chat_job(self, request: web.Request, body: ChatCompletionRequest) -> tuple[Job, str]:
        """The job, and the field its output constraint (if any) came from."""
        state = self.state
        state.check_model(body.model)
        check_n(body.n, state.options.max_n)
        tools = [tool_dict(t) for t in body.tools] if body.tools else None
        _check_tool_choice(body)
        template = body.chat_template or state.options.chat_template or state.recipe.template
        variables = thinking_variables(template_kwargs(body.chat_template_kwargs, template),
                                       template, body.reasoning_effort)
        prompt_ids = state.encode_chat(Chat(chat_messages(body.messages), tools),
                                       body.add_generation_prompt, body.chat_template,
                                       continue_final_message=body.continue_final_message,
                                       variables=variables)
        requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                            if body.max_completion_tokens is not None
                            else (body.max_tokens, "max_tokens"))
        forced = ""
        choice = body.tool_choice
        fmt = tool_format(state.options.tool_call_parser)
        if tools and fmt.name == "hermes" and (choice == "required" or
                                               isinstance(choice, NamedToolChoice)):
            if body.continue_final_message:
                raise invalid("continue_final_message cannot be combined with a required or "
                              "named tool_choice", param="tool_choice")
            prompt_ids, forced = state.force_tool_call(
                prompt_ids, [t["function"]["name"] for t in tools],
                None if choice == "required" else choice.function.name, body.chat_template)
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), state.max_model_len, param)
        budget = thinking_budget(state.reasoning, body.thinking_budget, body.reasoning_effort,
                                 max_tokens)
        params = params_from_fields(body, max_tokens, state.stop_token_ids,
                                    logprobs=_chat_logprobs_count(body))
        constrained = structured.for_chat(structured.from_openai(body), tools, fmt,
                                          _tool_choice_name(choice), body.parallel_tool_calls,
                                          forced)
        params = with_constraint(params, constrained, body.logit_bias, state)
        job = Job(req_id=f"chatcmpl-{request[REQ_ID]}", prompt_token_ids=prompt_ids,
                  forced_text=forced,
                  params=params, n=body.n, parse_tools=bool(tools) and body.tool_choice != "none",
                  tool_format=fmt.name, tools=tuple(tools or ()),
                  # a forced tool call starts the reply: no thinking block to parse
                  parse_reasoning=state.reasoning is not None and not forced,
                  thinking_budget=budget,
                  retention=request_retention(request, body.retention, bool(tools)),
                  cache_salt=state.keys.tenant_salt(request, body.cache_salt))
        return job, constrained.param if constrained else ""

    # ------------------------------------------------------------ completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self.state.admit():
            body = await read_json(request, CompletionRequest)
            prompts = await self.state.cpu.run(body_size(request), self._completion_prompts,
                                               body)
            constrained = structured.from_openai(body)
            jobs = [self._completion_job(request, body, p.token_ids, k, constrained)
                    for k, p in enumerate(prompts)]
            if constrained:
                await structured.check(constrained.constraint, constrained.param)
            reply = _Reply(f"cmpl-{request[REQ_ID]}", self.state.model_name,
                           len(jobs) * body.n)
            echoes = [prompts[i // body.n].text if body.echo else ""
                      for i in range(reply.num_choices)]
            async with contextlib.aclosing(self.state.pipeline.run(jobs)) as events:
                if body.stream:
                    include_usage = bool(body.stream_options and body.stream_options.include_usage)
                    return await _stream_completion(request, reply, events, include_usage,
                                                    echoes, body.n)
                results = await collect(events, reply.num_choices)
            return json_response(self._completion(reply, body, results, prompts, echoes))

    def _completion_prompts(self, body: CompletionRequest) -> list[_Prompt]:
        state = self.state
        state.check_model(body.model)
        check_n(body.n, state.options.max_n)
        if body.suffix is not None:
            raise invalid("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid("best_of is not supported (only best_of == n)", param="best_of")
        prompts = _split_prompts(body.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                out.append(_Prompt(state.encode_prompt(prompt), prompt))
            else:
                state.check_token_ids(prompt, "prompt")
                out.append(_Prompt(prompt, state.recipe.decode(prompt) if body.echo else ""))
        return out

    def _completion_job(self, request: web.Request, body: CompletionRequest,
                        prompt_ids: list[int], k: int,
                        constrained: structured.Requested | None) -> Job:
        state = self.state
        max_tokens = resolve_max_tokens(body.max_tokens, len(prompt_ids), state.max_model_len,
                                        default=16)
        params = params_from_fields(body, max_tokens, state.stop_token_ids,
                                    logprobs=body.logprobs)
        params = with_constraint(params, constrained, body.logit_bias, state)
        return Job(req_id=f"cmpl-{request[REQ_ID]}-{k}", prompt_token_ids=prompt_ids,
                   params=params, n=body.n,
                   retention=request_retention(request, body.retention, False),
                   cache_salt=state.keys.tenant_salt(request, body.cache_salt))

    def _completion(self, reply: _Reply, body: CompletionRequest, results: list[ChoiceResult],
                    prompts: list[_Prompt], echoes: list[str]) -> Completion:
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
        ids = await self.state.cpu.run(body_size(request), self._tokenize, body)
        return json_response(TokenizeResponse(ids, len(ids)))

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        if (body.messages is None) == (body.prompt is None):
            raise invalid("give exactly one of 'messages' or 'prompt'", param="messages")
        if body.prompt is not None:
            ids = self.state.encode_prompt(body.prompt)
        else:
            tools = [tool_dict(t) for t in body.tools] if body.tools else None
            ids = self.state.encode_chat(Chat(chat_messages(body.messages), tools),
                                         body.add_generation_prompt)
        return ids


# ================================================================ request conversion
def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> normalized messages (engine/text/messages.py), straight from the
    decoded structs: what their types do not say is checked here, once."""
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: ChatMessage, where: str) -> dict:
    content = _content_text(m.content, f"{where}.content")
    if content is None and not (m.role == "assistant" and m.tool_calls):
        raise invalid(f"{where}.content is required for role {m.role!r}",
                      param=f"{where}.content")
    if m.tool_calls and m.role != "assistant":
        raise invalid(f"{where}.tool_calls is only allowed on assistant messages",
                      param=f"{where}.tool_calls")
    calls = [normalized.tool_call(c.function.name, c.function.arguments, c.id)
             for c in m.tool_calls or []]
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None and m.role != "assistant":
        raise invalid(f"{where}.reasoning_content is only allowed on assistant messages",
                      param=f"{where}.reasoning_content")
    return normalized.message(m.role, content, name=m.name or None, tool_calls=calls,
                              tool_call_id=m.tool_call_id, reasoning=reasoning)


def _content_text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(f"{where}[{i}]: only text content parts are supported, got "
                          f"{part.type!r}", param=f"{where}[{i}].type")
        texts.append(part.text)
    return "\n".join(texts)


def tool_dict(tool: Tool) -> dict:
    """An OpenAI tool -> a normalized tool (parameters default to an empty object)."""
    fn = tool.function
    function: dict = {"name": fn.name}
    if fn.description is not None:
        function["description"] = fn.description
    function["parameters"] = fn.parameters if fn.parameters is not None else {
        "type": "object", "properties": {}}
    return normalized.tool(function)


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


def with_constraint(params, constrained: structured.Requested | None,
                    bias: dict[str, float] | None, state) -> SamplingParams:
    """params with the request's output constraint and logit bias."""
    changes: dict = {}
    if constrained is not None:
        if params.min_tokens:  # the grammar may be complete before min_tokens
            raise invalid("min_tokens cannot be combined with a constrained output "
                          f"({constrained.param})", param="min_tokens")
        changes["constraint"] = constrained.constraint
    if bias:
        changes["logit_bias"] = structured.logit_bias(bias)
        state.check_token_ids(list(changes["logit_bias"]), "logit_bias")
    return msgspec.structs.replace(params, **changes) if changes else params


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


class _Prompt(NamedTuple):
    token_ids: list[int]
    text: str  # as given, or decoded from token ids (for echo)


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

"""The one intake every API feeds: a normalized request becomes running jobs the same way for
OpenAI chat and completions, Anthropic messages, Responses and the WebSocket.

An API decodes its body (protocol structs) and hands `Intake.start` a converter of it to an
`Order`, the API-neutral request (as vLLM's one input processor makes one EngineCoreRequest
of every entry point). Then, for every API alike:

    1 validate     the converter's checks in the API's own terms; the model name, n, budgets
    2 render       a chat through the template, a completion prompt as written, ids checked:
                   in the CPU pool for a big body (frontend/offload.py), with step 1
    3 jobs         max_tokens, thinking budget, sampling params, a forced tool call's start
    4 constraints  output format and tool_choice -> one constraint, parsed off the loop
    5 retention    x-duplex-retention header or `retention` field, else agent iff tools
    6 admission    a ticket from the one `Admission` (frontend/admission.py): `admit`, before
                   the body is read, holds the request slot; once the prompts are tokenized
                   `ticket.reserve` holds the work bound
    7 submit       `Pipeline.run` with that reservation: its choices take turns at the fair gate

Where control tokens may come from (DESIGN invariant 3; docs/control-tokens.md):

* A chat (chat completions, messages, responses, the WebSocket, /tokenize's messages) is
  rendered by a template, which separates the user's text from the control tokens: only
  the template writes them; the same characters in a message stay plain text.
* A completion prompt (/v1/completions, /tokenize's prompt) has no template: the caller
  writes the whole prompt, so the text of a control token is that token (fill-in-the-middle
  markers, a client-side chat template), as llama.cpp and vLLM parse it.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, NamedTuple

import msgspec
from aiohttp import web

from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text.messages import Chat
from duplex.engine.text.tool_formats import tool_format
from duplex.engine.text.tool_parser import forced_call_prefix, tools_supported
from duplex.frontend import structured
from duplex.frontend.admission import Ticket, Work
from duplex.frontend.errors import invalid
from duplex.frontend.generation import (Event, Job, check_n, require_thinking,
                                        resolve_max_tokens, sampling_params, template_kwargs,
                                        thinking_budget, thinking_variables)
from duplex.frontend.offload import check_prompt_chars, text_chars
from duplex.frontend.retention import request_retention

if TYPE_CHECKING:
    from duplex.frontend.app_state import AppState


class ChatPrompt(NamedTuple):
    """A chat to render through the template."""
    chat: Chat
    add_generation_prompt: bool = True
    template: str | None = None  # the request's own chat template (a trust decision)
    continue_final_message: bool = False  # the last assistant message is the reply's start
    template_kwargs: dict | None = None  # variables the template reads
    effort: str | None = None  # "none" turns a template's enable_thinking switch off


@dataclasses.dataclass(frozen=True)
class Order:
    """One API request, normalized: what every API's body becomes before the intake."""
    req_id: str
    model: str | None  # None: whatever this server serves
    # a chat, or completion prompts (text or token ids), one job each
    prompt: ChatPrompt | list[str | list[int]]
    sampling: dict[str, Any]  # sampling_params fields; None: not given (max_tokens aside)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    default_max_tokens: int | None = None  # None: the rest of the context
    n: int = 1
    output_format: structured.Requested | None = None  # response_format & co.
    logit_bias: dict[str, float] | None = None
    tools: tuple[dict, ...] = ()  # normalized (OpenAI-shaped) tools
    tool_choice: str = "auto"  # none, auto, required, or a tool's name
    parallel_tool_calls: bool = True
    # a required or named call's start is written into the prompt (hermes format); else
    # the constraint alone makes the call
    prefill_tool_call: bool = False
    thinking_budget: int | None = None
    reasoning_effort: str | None = None
    thinking_param: str = "thinking_budget"
    retention: str | None = None  # the body's field; None: header, else tools decide
    cache_salt: str | None = None
    echo: bool = False  # completion prompts given as ids are decoded, to be echoed


class Prompt(NamedTuple):
    token_ids: list[int]
    text: str  # a completion prompt as given, or decoded from its ids for echo; else ""


class Started(NamedTuple):
    """An admitted request: its order, its jobs (one per prompt), their prompts, and the
    events of every choice (close them: `contextlib.aclosing`)."""
    order: Order
    jobs: list[Job]
    prompts: list[Prompt]
    events: AsyncIterator[Event]


class _Prepared(NamedTuple):
    order: Order
    jobs: list[Job]
    prompts: list[Prompt]
    constrained: structured.Requested | None


def work_of(jobs: list[Job]) -> Work:
    """Sequences (prompts x n) and prompt tokens (each prompt once) of an API request."""
    return Work(sum(job.n for job in jobs), sum(len(job.prompt_token_ids) for job in jobs))


class Intake:
    """Owns the path from an API's `Order` to the pipeline's events (module docstring)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def admit(self) -> Ticket:
        """A ticket for one request, holding its slot (`with intake.admit() as ticket`);
        raises ApiError at once (draining, no worker ready, overloaded)."""
        return self.state.admission.admit()

    async def start(self, ticket: Ticket, request: web.Request, size: int,
                    convert: Callable[..., Order], *args: Any) -> Started:
        """Steps 1-7 for `convert(*args)` under `ticket` (from `admit`); `size`: what the
        work weighs (offload.body_size). Raises ApiError before anything runs."""
        prepared = await self.state.cpu.run(size, self._prepare, request, convert, args)
        if prepared.constrained is not None:
            await structured.check(prepared.constrained.constraint, prepared.constrained.param)
        pipeline = self.state.pipeline
        pipeline.check(prepared.jobs)  # one that can never run here: 400, nothing reserved
        reservation = ticket.reserve(work_of(prepared.jobs))  # the work bound
        events = pipeline.run(prepared.jobs, reservation)  # fair gate, submit
        return Started(prepared.order, prepared.jobs, prepared.prompts, events)

    async def prompt_ids(self, size: int, convert: Callable[..., Order], *args: Any) -> list[int]:
        """Steps 1-3 up to the prompt's ids (a forced tool call's start included), for
        /tokenize and count_tokens."""
        return await self.state.cpu.run(size, self._prompt_ids, convert, args)

    # ------------------------------------------------------------ 1-3, in the pool when big
    def _prepare(self, request: web.Request, convert, args) -> _Prepared:
        order = self._validate(convert(*args))
        prompts = self._render(order)
        many = isinstance(order.prompt, list)
        built = [self._job(request, order, p.token_ids, f"{order.req_id}-{k}" if many
                           else order.req_id) for k, p in enumerate(prompts)]
        return _Prepared(order, [job for job, _ in built], prompts,
                         built[0][1] if built else None)

    def _prompt_ids(self, convert, args) -> list[int]:
        order = self._validate(convert(*args))
        [prompt] = self._render(order)
        return self._force_tool_call(order, prompt.token_ids)[0]

    def _validate(self, order: Order) -> Order:
        self.state.check_model(order.model)
        check_n(order.n, self.state.options.max_n)
        if order.thinking_budget is not None:  # before the prompt: the model decides it
            require_thinking(self.state.reasoning, order.thinking_param)
        return order

    def _render(self, order: Order) -> list[Prompt]:
        if isinstance(order.prompt, ChatPrompt):
            return [Prompt(self._encode_chat(order.prompt), "")]
        return [self._completion_prompt(p, order.echo) for p in order.prompt]

    def _job(self, request: web.Request, order: Order, prompt_ids: list[int],
             req_id: str) -> tuple[Job, structured.Requested | None]:
        state = self.state
        fmt = tool_format(state.options.tool_call_parser)
        prompt_ids, forced = self._force_tool_call(order, prompt_ids)
        max_tokens = resolve_max_tokens(order.max_tokens, len(prompt_ids), state.max_model_len,
                                        order.max_tokens_param, order.default_max_tokens)
        budget = thinking_budget(state.reasoning, order.thinking_budget, order.reasoning_effort,
                                 max_tokens, order.thinking_param)
        stop_ids = [] if order.sampling.get("ignore_eos") else state.stop_token_ids
        params = sampling_params(max_tokens=max_tokens, stop_token_ids=stop_ids,
                                 **order.sampling)
        constrained = structured.for_chat(order.output_format, list(order.tools), fmt,
                                          order.tool_choice, order.parallel_tool_calls, forced)
        params = self._with_constraint(params, constrained, order.logit_bias)
        job = Job(req_id=req_id, prompt_token_ids=prompt_ids, forced_text=forced, params=params,
                  n=order.n, parse_tools=bool(order.tools) and order.tool_choice != "none",
                  tool_format=fmt.name, tools=order.tools,
                  # a forced tool call starts the reply: no thinking block to parse
                  parse_reasoning=state.reasoning is not None and not forced,
                  thinking_budget=budget,
                  retention=request_retention(request, order.retention, bool(order.tools)),
                  cache_salt=state.keys.tenant_salt(request, order.cache_salt))
        return job, constrained

    # ------------------------------------------------------------ rendering
    def _encode_chat(self, prompt: ChatPrompt) -> list[int]:
        """Prompt ids of a chat; control tokens only where the template writes them. The
        template's refusals become 400s."""
        state = self.state
        if not prompt.chat.messages:
            raise invalid("messages must not be empty", param="messages")
        if prompt.template is not None and not state.options.allow_request_chat_template:
            raise invalid("a per-request chat_template is disabled on this server (the "
                          "operator can allow it with --allow-request-chat-template)",
                          param="chat_template", code="chat_template_disabled")
        self._check_chars(text_chars(prompt.chat.messages) + text_chars(prompt.chat.tools),
                          "messages")
        template = prompt.template if prompt.template is not None else \
            state.options.chat_template
        try:
            return self._render_chat(prompt, template)
        except (ValueError, TypeError) as e:  # RecipeError is a ValueError
            raise invalid(f"cannot apply the chat template: {e}", param="messages") from None

    def _render_chat(self, prompt: ChatPrompt, template: str | None) -> list[int]:
        recipe = self.state.recipe
        source = prompt.template or self.state.options.chat_template or recipe.template
        variables = thinking_variables(template_kwargs(prompt.template_kwargs, source),
                                       source, prompt.effort)
        extra = {"variables": variables} if variables else {}  # fakes need not know it
        if prompt.continue_final_message:  # keyword only when used: fakes need not know it
            return recipe.encode_chat(prompt.chat, template=template,
                                      continue_final_message=True, **extra)
        return recipe.encode_chat(prompt.chat, add_generation_prompt=prompt.add_generation_prompt,
                                  template=template, **extra)

    def _completion_prompt(self, prompt: str | list[int], echo: bool) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(self.encode_text(prompt), prompt)
        self.check_token_ids(prompt, "prompt")
        return Prompt(prompt, self.state.recipe.decode(prompt) if echo else "")

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt's ids: the caller wrote all of it, so a control token's text
        is that token (module docstring); BOS where the tokenizer adds one."""
        self._check_chars(text_chars(text), "prompt")
        recipe = self.state.recipe
        try:
            return recipe.encode_completion(text)
        except (ValueError, TypeError) as e:
            raise invalid(f"cannot tokenize the prompt: {e}", param="prompt") from None

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long for the context in any tokenization."""
        info = self.state.engine.ready_info
        if info is not None:
            check_prompt_chars(num_chars, info.max_model_len, self.state.max_token_chars, param)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.state.recipe.vocab_size
        if any(t >= vocab_size for t in token_ids):
            raise invalid(f"token ids must be below the vocabulary size {vocab_size}",
                          param=param)

    # ------------------------------------------------------------ tools and constraints
    def _force_tool_call(self, order: Order, prompt_ids: list[int]) -> tuple[list[int], str]:
        """(prompt ids that end inside the start of a tool call, that start's text) for a
        required or named tool_choice where the API prefills it; else (prompt_ids, "")."""
        state = self.state
        if not (order.prefill_tool_call and order.tools and order.tool_choice not in
                ("none", "auto") and tool_format(state.options.tool_call_parser).name == "hermes"):
            return prompt_ids, ""
        template = order.prompt.template if isinstance(order.prompt, ChatPrompt) else None
        source = template or state.options.chat_template or state.recipe.template
        if not tools_supported(source):
            raise invalid("this model's chat template has no tool calling, so a required or "
                          "named tool_choice cannot be honoured", param="tool_choice")
        names = [t["function"]["name"] for t in order.tools]
        forced = forced_call_prefix(names, None if order.tool_choice == "required"
                                    else order.tool_choice)
        return prompt_ids + state.recipe.encode_reply_start(forced), forced

    def _with_constraint(self, params: SamplingParams,
                         constrained: structured.Requested | None,
                         bias: dict[str, float] | None) -> SamplingParams:
        """params with the request's output constraint and logit bias."""
        changes: dict = {}
        if constrained is not None:
            if params.min_tokens:  # the grammar may be complete before min_tokens
                raise invalid("min_tokens cannot be combined with a constrained output "
                              f"({constrained.param})", param="min_tokens")
            changes["constraint"] = constrained.constraint
        if bias:
            changes["logit_bias"] = structured.logit_bias(bias)
            self.check_token_ids(list(changes["logit_bias"]), "logit_bias")
        return msgspec.structs.replace(params, **changes) if changes else params

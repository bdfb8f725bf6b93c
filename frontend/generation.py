"""The one per-request pipeline every API shares (the intake, frontend/intake.py, submits to it).

    AddRequest ─▶ engine deltas ─▶ OutputStream (detokenize, stop strings)
               ─▶ reasoning parser (thinking | answer) ─▶ tool calls (answer only) ─▶ Delta*, Final

The OutputStream (engine/text/output.py) is the one the offline API uses too.

`Pipeline.run(job)` yields, per choice, `Delta` events and then exactly one `Final`. A stop
string ends the choice at once: the engine stream is closed, which aborts the request on the
worker, and the stop text never reaches the client. `n > 1` runs n child requests
concurrently and interleaves their events (tagged by `index`). Closing the iterator early
(client gone) closes every engine stream, so every child is aborted on the worker.
The APIs only format these events; they never see token deltas.

Thinking budget: when a choice has spent `Job.thinking_budget` tokens inside its thinking
block, its engine stream is closed and the request continues as a new one whose output
already holds the tokens so far plus the block's closing text (`AddRequest.output_token_ids`,
the same path a resumed stream takes): the engine closes the block, the answer follows, and
the prompt and the tokens so far are prefix-cache hits.

Where a job's output is parsed for reasoning, its output constraint (JSON schema, regex,
grammar, tool calls) holds for the answer only: `Constraint.thinking` says where the block
starts as the parser reads it, and the worker's grammar begins after `</think>`
(engine/grammar.py), so a budget cut's closing text leads into the constrained answer.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator, NamedTuple

import msgspec

from duplex.engine.deadlines import DEADLINE_ERROR
from duplex.engine.messages import FAILURES, INVALID, AddRequest, FinishReason, RequestDelta
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text import reasoning as reasoning_text
from duplex.engine.text.output import OutputStream
from duplex.engine.text.reasoning import (CLOSE_TEXT, ReasoningFormat, detect_parser,
                                          template_variables)
from duplex.engine.text.tool_formats import tool_format
from duplex.engine.text.tool_parser import TextDelta, ToolCallArgsDelta, ToolCallStart
from duplex.frontend.admission import Reservation
from duplex.frontend.errors import ApiError, from_sampling_error, invalid
from duplex.frontend.protocol import SamplingFields

log = logging.getLogger("duplex.generation")

# The worker owns deadlines (engine/deadlines.py); one that never answers is cut off this
# long after it, so nothing hangs.
DEADLINE_GRACE_S = 5.0
_FAILURE_MESSAGES = {FinishReason.ERROR: "the engine worker failed",
                     FinishReason.TIMEOUT: DEADLINE_ERROR,
                     FinishReason.ABORT: "request aborted by the server"}


@dataclasses.dataclass(frozen=True)
class Job:
    """One API request, already tokenized and validated."""
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    parse_tools: bool = False
    # the start of the reply the prompt already holds (a forced tool call): the tool parser
    # reads it before the model's text; it is never sent as content
    forced_text: str = ""
    tool_format: str = "hermes"  # engine/text/tool_formats.py: how calls are written and parsed
    # the request's OpenAI-shaped tools: their schemas type qwen3_coder's parameter values
    tools: tuple[dict, ...] = ()
    retention: str = "chat"
    cache_salt: str = ""
    parse_reasoning: bool = False  # split the thinking block off (the server's format)
    thinking_budget: int | None = None  # tokens of thinking before the engine closes it


class TokenInfo(NamedTuple):
    """A sampled token with its text, logprob and top alternatives as (text, logprob)."""
    token_id: int
    text: str
    logprob: float
    top: list[tuple[str, float]]


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    reasoning_tokens: int = 0  # of completion_tokens, those inside the thinking block

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(NamedTuple):
    ttft_s: float
    tokens_per_s: float
    e2e_s: float
    queue_s: float = 0.0  # in the worker: arrival -> first scheduled (RequestDelta.queue_s)


@dataclasses.dataclass
class Delta:
    """What one engine step added to choice `index`, after detokenizing and stop strings."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenInfo]
    tool_events: list  # ToolCallStart | ToolCallArgsDelta | ToolCallEnd, in order
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    accepted_mask: list[bool] = dataclasses.field(default_factory=list)
    reasoning: str = ""  # thinking text (the answer is `text`)
    # the choice's usage so far (prompt and cached tokens known from the first delta on): the
    # one count every API reports, at the start of a stream as at its end
    usage: Usage | None = None


@dataclasses.dataclass
class Final:
    """The one terminal event of choice `index`.

    finish_reason: STOP | LENGTH | TOOL_CALLS (the client's answer ended) or one of
    engine.messages.FAILURES: ERROR | TIMEOUT | ABORT (it did not; `error` says why)."""
    index: int
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stop_sequence: str | None = None
    error: str = ""
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    is_invalid: bool = False  # the worker refused the request itself (RequestDelta.error_kind)

    @property
    def failed(self) -> bool:
        return self.finish_reason in FAILURES

    def api_error(self) -> ApiError:
        """How a failed choice is reported: a lost worker or an abort is worth retrying; a
        request the worker refused as invalid (it can never run) is not."""
        if self.is_invalid:
            return invalid(self.error, code="invalid_request")
        kind = "timeout" if self.finish_reason == FinishReason.TIMEOUT else "unavailable"
        return ApiError(kind, self.error, code=self.finish_reason)


Event = Delta | Final


def total_usage(finals: list[Final], n: int = 1) -> Usage:
    """Usage of a request: each prompt counts once (choices k*n .. k*n+n-1 share prompt k),
    completions add up."""
    firsts = [f.usage for f in finals if f.index % n == 0]
    by_tier: dict[str, int] = {}
    for usage in firsts:
        for tier, num in usage.cached_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + num
    return Usage(sum(u.prompt_tokens for u in firsts),
                 sum(f.usage.completion_tokens for f in finals),
                 sum(u.cached_tokens for u in firsts), by_tier,
                 sum(f.usage.reasoning_tokens for f in finals))


@dataclasses.dataclass
class ToolCallResult:
    id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it


@dataclasses.dataclass
class ChoiceResult:
    """A whole choice, for non-streaming responses."""
    index: int
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenInfo] = dataclasses.field(default_factory=list)
    tool_calls: dict[int, ToolCallResult] = dataclasses.field(default_factory=dict)
    final: Final | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.reasoning += delta.reasoning
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        for event in delta.tool_events:
            if isinstance(event, ToolCallStart):
                self.tool_calls[event.index] = ToolCallResult(event.id, event.name)
            elif isinstance(event, ToolCallArgsDelta):
                self.tool_calls[event.index].arguments += event.json_text


async def collect(events: AsyncIterator[Event], num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult(i) for i in range(num_choices)]
    async for event in events:
        if isinstance(event, Delta):
            results[event.index].add(event)
        else:
            results[event.index].final = event
    return results


# ---------------------------------------------------------------- building a job
def sampling_params(**fields) -> SamplingParams:
    """SamplingParams from API fields; None means "not given". Bad values -> 400."""
    given = {k: v for k, v in fields.items() if v is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    try:
        return SamplingParams(**given)
    except ValueError as e:
        raise from_sampling_error(e) from None


def sampling_fields(fields: SamplingFields, logprobs: int | None = None) -> dict:
    """The `sampling_params` fields the OpenAI APIs and the WebSocket share (max_tokens and
    stop_token_ids aside: the intake adds them)."""
    return dict(
        temperature=fields.temperature, top_p=fields.top_p, top_k=fields.top_k,
        min_p=fields.min_p, seed=fields.seed, stop=fields.stop,
        presence_penalty=fields.presence_penalty, frequency_penalty=fields.frequency_penalty,
        repetition_penalty=fields.repetition_penalty, min_tokens=fields.min_tokens,
        ignore_eos=fields.ignore_eos, skip_special_tokens=fields.skip_special_tokens,
        include_stop_str_in_output=fields.include_stop_str_in_output, logprobs=logprobs,
        speculate=fields.speculate)


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       param: str = "max_tokens", default: int | None = None) -> int:
    """The generation budget: what was asked, else `default`, else the rest of the context."""
    if num_prompt_tokens == 0:
        raise invalid("the prompt is empty", param="messages")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise invalid(f"the prompt has {num_prompt_tokens} tokens, more than this model's "
                      f"context length of {max_model_len} leaves room for",
                      param="messages", code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise invalid(f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        raise invalid(f"{param} is {requested}, but the context length of {max_model_len} "
                      f"leaves room for {room} after the {num_prompt_tokens}-token prompt",
                      param=param, code="context_length_exceeded")
    return requested


def check_fits(job: Job, ready) -> None:
    """A prompt longer than a worker's whole KV pool can never be computed, however long the
    client waits: a 400 naming the limit, not a retryable 503."""
    if ready is None:
        return
    capacity = ready.num_kv_blocks * ready.block_size
    num_tokens = len(job.prompt_token_ids)
    if num_tokens + 1 > capacity:
        raise invalid(f"the prompt has {num_tokens} tokens, but the KV cache pool holds "
                      f"{capacity} tokens ({ready.num_kv_blocks} blocks of {ready.block_size}) "
                      "and one more is needed to generate; no request this long can run on "
                      "this server", param="messages", code="kv_pool_exceeded")


class _Events:
    """The event stream of one `Pipeline.run`: closing it (the callers use `aclosing`) ends
    every choice and frees the request's reserved work, even if it was never iterated."""

    def __init__(self, source: AsyncIterator[Event], reservation: Reservation | None) -> None:
        self._source = source
        self._reservation = reservation

    def __aiter__(self) -> "_Events":
        return self

    async def __anext__(self) -> Event:
        try:
            return await anext(self._source)
        except StopAsyncIteration:
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self._source.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        if self._reservation is not None:
            self._reservation.release()


async def _take_turn(reservation: Reservation | None, tenant: str,
                     cutoff: float | None) -> bool:
    """Wait for the sequence's fair turn in the engine; False if the deadline came first."""
    if reservation is None:
        return True
    try:
        async with asyncio.timeout(_seconds_until(cutoff)):
            await reservation.begin_turn(tenant)
        return True
    except TimeoutError:
        return False


def check_n(n: int, max_n: int) -> None:
    if not 1 <= n <= max_n:
        raise invalid(f"n must be between 1 and {max_n}, got {n}", param="n")


# reasoning_effort -> thinking budget in tokens ("none": the smallest; a template with an
# `enable_thinking` switch turns thinking off instead)
EFFORT_BUDGETS = {"none": 1, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384}


def template_kwargs(kwargs: dict | None, template: str | None,
                    param: str = "chat_template_kwargs") -> dict:
    """A request's chat template variables, each one the template reads; else a 400
    naming the key."""
    if not kwargs:
        return {}
    unread = reasoning_text.unread_template_kwarg(kwargs, template, param)
    if unread is not None:
        raise invalid(unread[1], param=unread[0])
    return dict(kwargs)


def thinking_variables(kwargs: dict, template: str | None, effort: str | None) -> dict:
    """`kwargs` plus `enable_thinking: false` for reasoning effort "none" where the template
    has that switch (a request's own value wins)."""
    if effort == "none" and template and "enable_thinking" in template_variables(template):
        return {"enable_thinking": False, **kwargs}
    return kwargs


def require_thinking(reasoning: ReasoningFormat | None, param: str) -> None:
    """A 400 naming `param` when the model has no thinking block to budget."""
    if reasoning is None:
        raise invalid(f"{param}: this model has no thinking block (the server runs no "
                      "reasoning parser)", param=param)


def thinking_budget(reasoning: ReasoningFormat | None, budget: int | None, effort: str | None,
                    max_tokens: int, param: str = "thinking_budget") -> int | None:
    """The thinking budget of a request, from an explicit budget or a reasoning effort; a
    400 naming `param` for a budget <= 0, > max_tokens, or with no thinking block."""
    if budget is None and effort is None:
        return None
    require_thinking(reasoning, param if budget is not None else "reasoning_effort")
    if budget is None:
        budget = EFFORT_BUDGETS[effort]
        return budget if budget < max_tokens else None  # max_tokens ends it first
    if budget <= 0:
        raise invalid(f"{param} must be at least 1, got {budget}", param=param)
    if budget > max_tokens:
        raise invalid(f"{param} is {budget}, more than max_tokens ({max_tokens})", param=param)
    return budget


def reasoning_format(options, recipe) -> ReasoningFormat | None:
    """The server's reasoning format: `options.reasoning_parser` (checked against the chat
    template: ValueError with the reason when it does not fit), or the one the template
    asks for unambiguously when none was named; None: no reasoning parser."""
    template = options.chat_template or recipe.template
    name = options.reasoning_parser
    if name == "none":
        return None
    if name is None:
        name = detect_parser(template)
        if name is None:
            return None
    reasoning_text.check_fits(name, template)
    return ReasoningFormat.for_recipe(name, recipe)


# ---------------------------------------------------------------- the pipeline
class Pipeline:
    """Owns the path from an engine's token deltas to API-neutral output events."""

    def __init__(self, engine, recipe, metrics, *, request_timeout_s: float = 0.0,
                 reasoning: ReasoningFormat | None = None) -> None:
        self.engine = engine
        self.recipe = recipe
        self.reasoning = reasoning  # None: no reasoning parser on this server
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self._token_text: dict[int, str] = {}

    def check(self, jobs: list[Job]) -> None:
        """A job that can never run here raises ApiError (400) now, before any response
        starts, so a stream never opens for it."""
        for job in jobs:
            check_fits(job, self.engine.ready_info)

    def run(self, jobs: Job | list[Job],
            reservation: Reservation | None = None) -> AsyncIterator[Event]:
        """Events of every choice of every job, interleaved; choice `index` counts across
        jobs (job k's sample j is `k * n + j`). Each choice ends with exactly one Final.
        Raises as `check` does. `reservation`: the request's admitted work
        (frontend/admission.py), through which each choice takes and ends its turn at the
        fair gate and which is freed when the events end; None: no gate (offline tests)."""
        jobs = [jobs] if isinstance(jobs, Job) else jobs
        self.check(jobs)
        return _Events(self._events(jobs, reservation), reservation)

    async def _events(self, jobs: list[Job],
                      reservation: Reservation | None) -> AsyncIterator[Event]:
        choices = [_Choice(self, job, sample, k * job.n + sample)
                   for k, job in enumerate(jobs) for sample in range(job.n)]
        source = (self._run_choice(choices[0], reservation) if len(choices) == 1
                  else self._fan_out(choices, reservation))
        async with contextlib.aclosing(source) as events:
            async for event in events:
                yield event

    async def _fan_out(self, choices: list[_Choice],
                       reservation: Reservation | None) -> AsyncIterator[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            async with contextlib.aclosing(self._run_choice(choice, reservation)) as events:
                async for event in events:
                    queue.put_nowait(event)

        tasks = [asyncio.create_task(pump(choice)) for choice in choices]
        try:
            num_open = len(choices)
            while num_open:
                event = await queue.get()
                num_open -= isinstance(event, Final)
                yield event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_choice(self, choice: _Choice,
                          reservation: Reservation | None = None) -> AsyncIterator[Event]:
        msg = choice.add_request()
        cutoff = msg.deadline + DEADLINE_GRACE_S if msg.deadline else None
        final = None
        has_turn = await _take_turn(reservation, choice.job.cache_salt, cutoff)
        if not has_turn:
            final = choice.fail(FinishReason.TIMEOUT,
                                "request timed out waiting for its turn to run")
        try:
            while final is None:  # more than once only after a thinking-budget cut
                async with contextlib.aclosing(self._engine_events(choice, msg, cutoff)) as events:
                    async for event in events:
                        if isinstance(event, Final):
                            final = event
                        else:
                            yield event
                if final is None:
                    msg, event = choice.close_thinking(msg)
                    yield event
        finally:
            if has_turn and reservation is not None:
                reservation.end_turn()
        self.metrics.observe_final(final)
        _log_final(msg.req_id, final)
        yield final

    async def _engine_events(self, choice: _Choice, msg: AddRequest,
                             cutoff: float | None) -> AsyncIterator[Event]:
        """Events of one engine stream, ending with the Final, or without one when the
        thinking budget is spent (closing the stream aborts the request on the worker)."""
        async with contextlib.aclosing(self.engine.generate(msg)) as deltas:
            while True:
                try:
                    async with asyncio.timeout(_seconds_until(cutoff)):
                        delta = await anext(deltas)
                except StopAsyncIteration:
                    yield choice.fail(FinishReason.ERROR,
                                      "the engine stream ended without a result")
                    return
                except TimeoutError:
                    yield choice.fail(FinishReason.TIMEOUT, DEADLINE_ERROR)
                    return
                except Exception as e:  # noqa: BLE001 - the engine failed: end it
                    log.exception("engine stream failed req_id=%s", msg.req_id)
                    yield choice.fail(FinishReason.ERROR, f"engine error: {e}")
                    return
                event, final = choice.on_delta(delta)
                if event is not None:
                    yield event
                if final is not None:
                    yield final
                    return
                if choice.is_over_budget():
                    return

    def token_info(self, top_logprob) -> TokenInfo:
        top = [(self.token_text(t), lp) for t, lp in top_logprob.top]
        return TokenInfo(top_logprob.token_id, self.token_text(top_logprob.token_id),
                         top_logprob.logprob, top)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.recipe.decode(
                [token_id], skip_special_tokens=False)
        return text


class _Choice:
    """The state of one choice while its deltas arrive (output text stream, tool parser)."""

    def __init__(self, pipeline: Pipeline, job: Job, sample: int, index: int) -> None:
        self.pipeline = pipeline
        self.job = job
        self.sample = sample  # which of the job's n samples this is
        self.index = index  # its place among all choices of the API request
        self.stream = OutputStream.for_params(pipeline.recipe, job.params)
        self.tools = tool_format(job.tool_format).new_parser(list(job.tools)) \
            if job.parse_tools else None
        self.reasoning_format = pipeline.reasoning if job.parse_reasoning else None
        prompt_tail = "" if self.reasoning_format is None else \
            _prompt_tail(pipeline.recipe, job.prompt_token_ids)
        self.reasoning = None if self.reasoning_format is None else \
            self.reasoning_format.new_parser(prompt_tail)
        self.params = self._after_thinking(job.params, prompt_tail)
        self.output_ids: list[int] = []
        self.num_reasoning_tokens = 0
        self.num_cuts = 0
        self._forced_events = self.tools.push(job.forced_text) \
            if self.tools is not None and job.forced_text else []
        self.has_tool_calls = False
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.cached_by_tier: dict[str, int] = {}
        self.num_draft_proposed = 0
        self.num_draft_accepted = 0
        self.start = time.time()
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.num_first_tokens = 0  # tokens of the first delta (more than one with drafts)
        self.queue_s = 0.0
        self.deadline = 0.0

    def _after_thinking(self, params: SamplingParams, prompt_tail: str) -> SamplingParams:
        """params whose output constraint (if any) holds after the thinking block, where the
        output is parsed for reasoning: the answer is constrained, the thinking is not."""
        if params.constraint is None or self.reasoning_format is None:
            return params
        start = self.reasoning_format.constraint_start(prompt_tail)
        constraint = msgspec.structs.replace(params.constraint, thinking=start)
        return msgspec.structs.replace(params, constraint=constraint)

    def add_request(self) -> AddRequest:
        job, params = self.job, self.params
        req_id = job.req_id if job.n == 1 else f"{job.req_id}-{self.sample}"
        if self.sample and params.seed is not None:  # n samples of one seed: vary it
            params = msgspec.structs.replace(params, seed=(params.seed + self.sample) % 2**63)
        timeout = self.pipeline.request_timeout_s
        self.deadline = self.start + timeout if timeout > 0 else 0.0
        return AddRequest(req_id=req_id, prompt_token_ids=job.prompt_token_ids, params=params,
                          arrival_time=self.start, cache_salt=job.cache_salt,
                          retention=job.retention, deadline=self.deadline)

    def on_delta(self, delta: RequestDelta) -> tuple[Delta | None, Final | None]:
        """One engine delta -> (an output event or None, the Final if the choice ended)."""
        self._count(delta)
        engine_finish = delta.finish_reason
        is_complete = engine_finish is not None and engine_finish not in FAILURES
        # a failed stream's held-back text (a broken character, a partial stop string) is dropped
        text = self._push_text(delta.new_token_ids, is_complete)
        finish_reason = self.stream.finish_reason(engine_finish)
        reasoning, text = self._parse_reasoning(delta.new_token_ids, text,
                                                finish_reason is not None)
        text, tool_events = self._parse_tools(text, finish_reason is not None)
        event = self._event(delta, text, tool_events, reasoning)
        if finish_reason is None:
            return event, None
        if finish_reason in FAILURES:
            final = self.fail(_failure(finish_reason, delta.error), delta.error)
            final.is_invalid = delta.error_kind == INVALID
            return event, final
        return event, self.finish(finish_reason, self.stream.stop_str)

    def is_over_budget(self) -> bool:
        """The thinking budget is spent, the block still open, and room left to close it
        (once: after the cut the block is closed, whatever text a stop string holds back)."""
        budget = self.job.thinking_budget
        if budget is None or self.num_cuts or self.reasoning is None \
                or not self.reasoning.in_reasoning:
            return False
        room = (self.job.params.max_tokens or 1 << 30) - self.num_tokens
        return self.num_reasoning_tokens >= budget and room > len(self._close_ids())

    def close_thinking(self, msg: AddRequest) -> tuple[AddRequest, Delta]:
        """The request that continues after the engine closes the thinking block, and the
        event of the closing tokens (which the client sees like any other tokens)."""
        close_ids = self._close_ids()
        self.num_cuts += 1
        self.num_tokens += len(close_ids)
        text = self._push_text(close_ids, False)
        reasoning, text = self._parse_reasoning([], text, False)
        text, tool_events = self._parse_tools(text, False)
        event = Delta(self.index, text, list(close_ids), [], tool_events, reasoning=reasoning,
                      usage=self._usage())
        return msgspec.structs.replace(msg, req_id=f"{msg.req_id}~think",
                                       output_token_ids=list(self.output_ids)), event

    def _close_ids(self) -> list[int]:
        return self.pipeline.recipe.encode_reply_start(CLOSE_TEXT)

    def finish(self, finish_reason: FinishReason, stop_sequence: str | None = None) -> Final:
        if finish_reason == FinishReason.STOP and self.has_tool_calls:
            finish_reason = FinishReason.TOOL_CALLS
        return Final(self.index, finish_reason, self._usage(), self._timings(),
                     stop_sequence=stop_sequence, num_draft_proposed=self.num_draft_proposed,
                     num_draft_accepted=self.num_draft_accepted)

    def fail(self, finish_reason: FinishReason, error: str) -> Final:
        final = self.finish(finish_reason)
        final.error = error or _FAILURE_MESSAGES[finish_reason]
        return final

    # ------------------------------------------------------------ steps
    def _count(self, delta: RequestDelta) -> None:
        if delta.new_token_ids:
            self.last_token_at = time.time()
            if not self.first_token_at:
                self.first_token_at = self.last_token_at
                self.num_first_tokens = len(delta.new_token_ids)
        self.num_tokens += len(delta.new_token_ids)
        if not self.num_cuts:  # a continuation's hits cover its output too: not the prompt's
            self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
            if delta.cached_tokens_by_tier:
                self.cached_by_tier = dict(delta.cached_tokens_by_tier)
        self.num_draft_proposed += delta.num_draft_proposed
        self.num_draft_accepted += delta.num_draft_accepted
        self.queue_s = max(self.queue_s, delta.queue_s)
        self.pipeline.metrics.observe_delta(len(delta.new_token_ids), delta.num_draft_proposed,
                                            delta.num_draft_accepted)

    def _push_text(self, token_ids: list[int], is_last: bool) -> str:
        """Detokenized text of new ids; special marker tokens (dropped by the detokenizer)
        come back as their text, so the reasoning parser sees them where they were."""
        self.output_ids += token_ids
        if self.reasoning_format is None:
            return self.stream.push(token_ids, is_last=is_last)
        return self.reasoning_format.push_ids(self.stream, token_ids, is_last)

    def _parse_reasoning(self, token_ids: list[int], text: str,
                         is_last: bool) -> tuple[str, str]:
        """(thinking text, answer text) of a delta; its tokens count as reasoning when the
        block was open before it or is open after it."""
        if self.reasoning is None:
            return "", text
        was_open = self.reasoning.in_reasoning
        split = self.reasoning.push(text)
        if is_last:
            end = self.reasoning.finish()
            split = split._replace(reasoning=split.reasoning + end.reasoning,
                                   answer=split.answer + end.answer)
        if was_open or self.reasoning.in_reasoning or split.reasoning:
            self.num_reasoning_tokens += len(token_ids)
        return split.reasoning, split.answer

    def _parse_tools(self, text: str, is_last: bool) -> tuple[str, list]:
        if self.tools is None:
            return text, []
        events, self._forced_events = self._forced_events, []
        events += self.tools.push(text) if text else []
        if is_last:
            events += self.tools.finish()
        plain = "".join(e.text for e in events if isinstance(e, TextDelta))
        tool_events = [e for e in events if not isinstance(e, TextDelta)]
        self.has_tool_calls |= bool(tool_events)
        return plain, tool_events

    def _event(self, delta: RequestDelta, text: str, tool_events: list,
               reasoning: str = "") -> Delta | None:
        if not (text or reasoning or tool_events or delta.new_token_ids):
            return None
        logprobs = [self.pipeline.token_info(lp) for lp in delta.logprobs]
        return Delta(self.index, text, list(delta.new_token_ids), logprobs, tool_events,
                     delta.num_draft_proposed, delta.num_draft_accepted,
                     list(delta.accepted_draft_mask), reasoning, self._usage())


    def _usage(self) -> Usage:
        return Usage(len(self.job.prompt_token_ids), self.num_tokens, self.num_cached_tokens,
                     self.cached_by_tier, self.num_reasoning_tokens)

    def _timings(self) -> Timings:
        end = time.time()
        if not self.first_token_at:
            return Timings(0.0, 0.0, end - self.start, self.queue_s)
        # decode rate: tokens after the first delta over the time they took to arrive; 0 when
        # every token came at once (a rate over no time means nothing)
        decode_s = self.last_token_at - self.first_token_at
        later = self.num_tokens - self.num_first_tokens
        rate = later / decode_s if later > 0 and decode_s > 0 else 0.0
        return Timings(self.first_token_at - self.start, rate, end - self.start, self.queue_s)


def _failure(finish_reason: FinishReason, error: str) -> FinishReason:
    """The API failure of an engine finish: the worker's deadline abort is a timeout."""
    if finish_reason == FinishReason.ABORT and error == DEADLINE_ERROR:
        return FinishReason.TIMEOUT
    return finish_reason


def _prompt_tail(recipe, prompt_ids: list[int]) -> str:
    """The prompt's last tokens as text, special tokens kept: where a thinking block opens."""
    return recipe.decode(prompt_ids[-8:], skip_special_tokens=False)


def _seconds_until(cutoff: float | None) -> float | None:
    return None if cutoff is None else max(0.0, cutoff - time.time())


def _log_final(req_id: str, final: Final) -> None:
    log.info("request finished req_id=%s finish_reason=%s prompt_tokens=%d "
             "completion_tokens=%d cached_tokens=%d ttft_s=%.4f e2e_s=%.4f%s",
             req_id, final.finish_reason, final.usage.prompt_tokens,
             final.usage.completion_tokens, final.usage.cached_tokens, final.timings.ttft_s,
             final.timings.e2e_s, f" error={final.error!r}" if final.error else "")


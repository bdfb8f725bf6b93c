"""Offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(conversations, params)`.

An in-process frontend around EngineCore: it tokenizes with the same recipe layer as the
server (so `chat` is injection-safe), steps the engine until every request finishes, and
turns token ids into text with the same OutputStream (engine/text/output.py): detokenizer,
stop strings.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from tqdm import tqdm

from duplex.engine.config import EngineConfig
from duplex.engine.core import EngineCore
from duplex.engine.messages import AddRequest, FinishReason, RequestDelta, TokenLogprob
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text.messages import Chat
from duplex.engine.text.output import OutputStream
from duplex.engine.text.reasoning import unread_template_kwarg


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None
    num_cached_tokens: int
    stop_reason: int | str | None = None


class _Tracker:
    """Per-request output state: tokens, logprobs, and the text of its OutputStream."""

    def __init__(self, recipe, prompt_ids: list[int], params: SamplingParams) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.stream = OutputStream.for_params(recipe, params)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_cached = 0

    def push(self, delta: RequestDelta) -> bool:
        """Take one delta; True when this request is done (engine finish or a stop string)."""
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.logprobs
        self.num_cached = delta.num_cached_tokens
        self.stream.push(delta.new_token_ids, is_last=delta.finish_reason is not None)
        self.finish_reason = self.stream.finish_reason(delta.finish_reason)
        if self.stream.is_stopped:
            self.stop_reason = "stop_string"
        elif delta.finish_reason is not None:
            self.stop_reason = delta.stop_reason
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        return RequestOutput(self.prompt_ids, self.token_ids, self.stream.text,
                             self.finish_reason,
                             self.logprobs if self.params.logprobs is not None else None,
                             self.num_cached, self.stop_reason)


def _template_kwargs(kwargs: dict | None, template: str | None) -> dict:
    """`kwargs` where the template reads every key; else a ValueError naming the key (the
    server's rule, engine/text/reasoning.py)."""
    unread = unread_template_kwarg(kwargs, template)
    if unread is not None:
        raise ValueError(unread[1])
    return dict(kwargs or {})


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 tokenizer: bool = True, progress: bool = True, **engine_kwargs) -> None:
        """`LLM(model, **flat_engine_fields)` or `LLM(config=EngineConfig(...))`, not both."""
        if config is not None and (model is not None or engine_kwargs):
            raise ValueError("LLM takes a config or a model with engine fields, not both")
        self.config = config or EngineConfig.of(model=model, **engine_kwargs)
        self.engine = EngineCore(self.config, progress=progress)
        self.recipe = None
        if tokenizer:
            from duplex.engine.text.recipe import Recipe

            self.recipe = Recipe.from_model(self.engine.model_path)
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._encode(p) for p in prompts]
        return self._run(token_lists, params, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """`chat_template` replaces the model's; `chat_template_kwargs` are variables the
        template reads (e.g. enable_thinking), each key checked as the server checks it."""
        if self.recipe is None:
            raise ValueError("LLM.chat needs the tokenizer (LLM(tokenizer=True))")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        variables = _template_kwargs(chat_template_kwargs,
                                     chat_template or self.recipe.template)
        # user dicts: validated here, once (engine/text/messages.py)
        token_lists = [self.recipe.encode_chat(Chat.from_dicts(c, tools),
                                               template=chat_template, variables=variables)
                       for c in conversations]
        return self._run(token_lists, params, use_tqdm)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.recipe is None:
                raise ValueError("string prompts need the tokenizer (LLM(tokenizer=True))")
            return self.recipe.encode_completion(prompt)  # as /v1/completions: control tokens parsed
        return list(prompt)

    def _run(self, token_lists: list[list[int]], params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else \
            [params] * len(token_lists)
        if len(params_list) != len(token_lists):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(token_lists)} prompts")
        trackers: dict[str, _Tracker] = {}
        for ids, p in zip(token_lists, params_list):
            req_id = f"llm-{next(self._ids)}"
            self.engine.add_request(AddRequest(req_id, ids, p))
            trackers[req_id] = _Tracker(self.recipe, ids, p)
        self._drive(trackers, use_tqdm)
        return [t.output() for t in trackers.values()]

    def _drive(self, trackers: dict[str, _Tracker], use_tqdm: bool) -> None:
        pending = set(trackers)
        bar = tqdm(total=len(trackers), desc="generating", disable=not use_tqdm)
        try:
            while pending:
                for delta in self.engine.step():
                    if delta.req_id in pending and trackers[delta.req_id].push(delta):
                        pending.discard(delta.req_id)
                        bar.update(1)
                        if not delta.finish_reason:  # a stop string ended it early
                            self.engine.abort_requests([delta.req_id])
        except BaseException:
            self.engine.abort_requests(list(pending))
            self.engine.step()
            raise
        finally:
            bar.close()

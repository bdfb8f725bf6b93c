"""Deterministic stand-ins for the engine client and the recipe, for fast frontend tests.

FakeRecipe: one token per UTF-8 byte (id = byte + 10), a plain-text chat format, eos id 2.
FakeEngineClient: answers every request with `reply` (a string, or a function of the
AddRequest), one token per delta, and records what was added, finished and aborted.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from duplex.engine.deadlines import DEADLINE_ERROR
from duplex.engine.messages import AddRequest, Ready, RequestDelta, TokenLogprob, WorkerStats
from duplex.engine.text.messages import Chat

EOS = 2
OFFSET = 10


class RecipeError(ValueError):
    pass


class FakeDetokenizer:
    def __init__(self) -> None:
        self.pending = b""

    def push(self, ids: list[int]) -> str:
        self.pending += bytes(i - OFFSET for i in ids if i >= OFFSET)
        for cut in range(len(self.pending), max(len(self.pending) - 4, -1), -1):
            try:
                text = self.pending[:cut].decode()
            except UnicodeDecodeError:
                continue
            self.pending = self.pending[cut:]
            return text
        return ""

    def flush(self) -> str:
        text, self.pending = self.pending.decode(errors="replace"), b""
        return text


class FakeRecipe:
    eos_token_ids = [EOS]
    vocab_size = 256 + OFFSET
    # enough of a Hermes-style template for tool_parser.tools_supported
    template = "{% if tools %}<tools>{{ tools }}</tools>{% endif %} ... <tool_call>"
    tokenizer = None  # no vocabulary: the longest token's text is unknown

    def __init__(self) -> None:
        self.chat_calls: list[dict] = []

    def encode_prompt(self, text: str) -> list[int]:
        return [b + OFFSET for b in text.encode()]

    def encode_chat(self, chat: Chat, add_generation_prompt=True, template=None,
                    continue_final_message=False):
        assert isinstance(chat, Chat), "the recipe renders only a normalized Chat"
        messages, tools = chat
        self.chat_calls.append({"messages": messages, "tools": tools, "template": template})
        if continue_final_message:  # the history, the assistant tag, the text to continue
            if messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls"):
                raise RecipeError("continuing the final message needs a final assistant message")
            return self.encode_chat(Chat(messages[:-1], tools), True, template) + \
                self.encode_prompt(messages[-1]["content"])
        if template is not None and ("__" in template or "{%" in template):
            raise RecipeError("template rejected by the sandbox")
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        if tools:
            text = "<tools>" + json.dumps(tools) + "\n" + text
        return self.encode_prompt(text + ("<assistant>" if add_generation_prompt else ""))

    def encode_reply_start(self, text: str) -> list[int]:
        return self.encode_prompt(text)

    def encode_completion(self, text: str) -> list[int]:  # no control tokens to parse here
        return self.encode_prompt(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")

    def new_detokenizer(self, skip_special_tokens: bool = True) -> FakeDetokenizer:
        return FakeDetokenizer()


class FakeEngineClient:
    def __init__(self, reply: str | Callable[[AddRequest], str] = "Hello there, friend!",
                 max_model_len: int = 512, step_s: float = 0.0, num_cached: int = 0,
                 cached_by_tier: dict | None = None, draft: tuple[int, int] = (0, 0),
                 batch_invariant: bool = False) -> None:
        self.reply = reply
        self.step_s = step_s
        self.num_cached = num_cached
        self.cached_by_tier = cached_by_tier or {}
        self.draft = draft
        self.fail_after: int | None = None  # tokens before a simulated worker death
        self.hang = False  # never produce a token
        self.ready = True
        self.ready_info: Ready | None = Ready(
            worker_id="w0", role="unified", model_name="fake-model", max_model_len=max_model_len,
            block_size=16, num_kv_blocks=64, batch_invariant=batch_invariant, num_threads=2,
            weights="float32")
        self.added: list[AddRequest] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self.active)

    def stats(self) -> WorkerStats:
        return WorkerStats(num_running=len(self.active), num_waiting=0,
                           num_kv_blocks_total=64, num_kv_blocks_used=4 * len(self.active),
                           num_prompt_tokens=100, num_cached_prompt_tokens=25)

    def worker_stats(self) -> dict[str, WorkerStats]:
        return {}  # one worker, no per-worker view (a test may set its own)

    def workers(self) -> dict[str, Ready]:
        return {self.ready_info.worker_id: self.ready_info} if self.ready_info else {}

    def reply_ids(self, msg: AddRequest) -> list[int]:
        text = self.reply(msg) if callable(self.reply) else self.reply
        return [b + OFFSET for b in text.encode()]

    async def generate(self, msg: AddRequest):
        self.added.append(msg)
        self.active.add(msg.req_id)
        done = False
        try:
            async for delta in self._deltas(msg):
                done = delta.finish_reason is not None
                yield delta
        finally:
            self.active.discard(msg.req_id)
            (self.finished if done else self.aborted).append(msg.req_id)

    async def _deltas(self, msg: AddRequest):
        ids = self.reply_ids(msg) + [EOS]
        params = msg.params
        limit = params.max_tokens or len(ids)
        for i, token_id in enumerate(ids[:limit]):
            await asyncio.sleep(self.step_s)
            while self.hang:
                await asyncio.sleep(0.01)
            if msg.deadline and time.time() > msg.deadline:  # as engine.deadlines ends it
                yield RequestDelta(msg.req_id, [], finish_reason="abort", error=DEADLINE_ERROR)
                return
            if self.fail_after is not None and i >= self.fail_after:
                yield RequestDelta(msg.req_id, [], finish_reason="error", error="worker died")
                return
            finish = ("stop" if token_id == EOS and not params.ignore_eos
                      else "length" if i + 1 == limit else None)
            new_ids = [] if finish == "stop" else [token_id]
            yield RequestDelta(
                msg.req_id, new_ids, logprobs=self._logprobs(params, new_ids),
                finish_reason=finish, stop_reason=EOS if finish == "stop" else None,
                num_prompt_tokens=len(msg.prompt_token_ids), num_cached_tokens=self.num_cached,
                cached_tokens_by_tier=self.cached_by_tier,
                num_draft_proposed=self.draft[0], num_draft_accepted=self.draft[1],
                accepted_draft_mask=[True] * len(new_ids) if self.draft[1] else [])
            if finish:
                return

    @staticmethod
    def _logprobs(params, ids: list[int]) -> list[TokenLogprob]:
        if params.logprobs is None:
            return []
        return [TokenLogprob(t, -0.25, [(t, -0.25), (t + 1, -2.0), (t + 2, -3.0)][:params.logprobs])
                for t in ids]

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    async def close(self) -> None:
        pass

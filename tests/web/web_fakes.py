"""A scripted fake engine for the browser tests, and a Duplex app that runs it in a thread.

ScriptedEngine answers by the last user message (FakeRecipe's one token per UTF-8 byte):
"html" -> raw HTML, "long" -> an answer long enough to stop, "fail" -> a worker error after a
few tokens; anything else -> a short markdown answer. Steps alternate between a speculative
one (two words of accepted draft tokens, then one word from the target) and a plain one-word
step, and every answer reports cached prompt tokens on two tiers.

ThreadedServer runs the real aiohttp app (`frontend.server.build_app`, static web/ included)
on its own event loop, so synchronous Playwright can drive a browser against it; `stop` and
`start` keep the port, as a restarting server would.
"""
from __future__ import annotations

import asyncio
import re
import socket
import threading

import msgspec
from aiohttp import web
from frontend_fakes import OFFSET, FakeEngineClient, FakeRecipe

from duplex.engine.messages import AddRequest, RequestDelta
from duplex.frontend.server import AppState, ServerOptions, build_app

MARKDOWN_REPLY = (
    "Duplex splits serving into **prefill** and **decode**.\n\n"
    "- prefill reads the prompt in one pass\n"
    "- decode writes one token at a time\n\n"
    "Try it from Python:\n\n"
    "```python\nprint(\"hello from duplex\")\n```\n"
    "Repeated context is a `cache hit`, never recomputed.")
HTML_REPLY = "<script>alert(1)</script><b>x</b>"
RICH_REPLY = (
    "| engine | step |\n| --- | --- |\n| duplex | 10 ms |\n| other | 12 ms |\n\n"
    "```python\ndef hello():\n    return \"<b>hi</b>\"\n```\n\n"
    "Inline $e^{i\\pi}+1=0$ and a block:\n\n$$\n\\int_0^1 x\\,dx = \\tfrac12\n$$\n\n"
    "<script>alert(3)</script> [click](javascript:alert(4)) "
    "<img src=x onerror=alert(5)> [safe](https://example.com/)")
# Long enough (about 4 minutes at 20 ms a step) that no test sees it end before it clicks stop,
# however slowly a loaded box renders: a stream that ended first hides the stop button.
LONG_REPLY = ("All work and no play makes a long answer. " * 5 + "\n\n") * 400
FAIL_AFTER_TOKENS = 12


def last_user_text(prompt_token_ids: list[int]) -> str:
    """FakeRecipe renders '<role>content\\n' per message; the text after the last '<user>'."""
    text = bytes(i - OFFSET for i in prompt_token_ids if i >= OFFSET).decode(errors="replace")
    return text.rsplit("<user>", 1)[-1].split("\n<assistant>", 1)[0]


def reply_for(question: str) -> str:
    lowered = question.lower()
    if "html" in lowered:
        return HTML_REPLY
    if "rich" in lowered:
        return RICH_REPLY
    if "long" in lowered:
        return LONG_REPLY
    return MARKDOWN_REPLY


def steps(reply: str) -> list[tuple[list[int], list[bool]]]:
    """The reply as engine steps of whole words, (token ids, accepted_mask) each: a speculative
    step (two words from accepted drafts, one from the target model), then a plain one-word
    step, and so on."""
    pieces = re.findall(r"\S+\s*|\s+", reply)
    plan, i = [], 0
    while i < len(pieces):
        num_drafted = 2 if len(plan) % 2 == 0 else 0
        drafted = encode("".join(pieces[i:i + num_drafted]))
        target = encode("".join(pieces[i + num_drafted:i + num_drafted + 1]))
        plan.append((drafted + target, [True] * len(drafted) + [False] * len(target)))
        i += num_drafted + 1
    return plan


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


class ScriptedEngine(FakeEngineClient):
    def __init__(self, step_s: float = 0.01) -> None:
        super().__init__(step_s=step_s, max_model_len=4096)
        self.ready_info = msgspec.structs.replace(self.ready_info, speculation="ngram")

    async def _deltas(self, msg: AddRequest):
        question = last_user_text(msg.prompt_token_ids)
        limit = msg.params.max_tokens or 1 << 30
        fail_after = FAIL_AFTER_TOKENS if "fail" in question.lower() else None
        plan = steps(reply_for(question))
        num_sent = 0
        for step, (new_ids, mask) in enumerate(plan):
            await asyncio.sleep(self.step_s)
            if fail_after is not None and num_sent >= fail_after:
                yield RequestDelta(msg.req_id, [], finish_reason="error",
                                   error="worker died (scripted)")
                return
            new_ids, mask = new_ids[:limit - num_sent], mask[:limit - num_sent]
            num_sent += len(new_ids)
            is_last = step == len(plan) - 1
            finish = "stop" if is_last else "length" if num_sent >= limit else None
            yield RequestDelta(
                msg.req_id, new_ids, finish_reason=finish,
                num_prompt_tokens=len(msg.prompt_token_ids),
                **self.cache_fields(len(msg.prompt_token_ids)),
                num_draft_proposed=len(mask) if any(mask) else 0,
                num_draft_accepted=sum(mask), accepted_draft_mask=mask)
            if finish:
                return

    @staticmethod
    def cache_fields(num_prompt_tokens: int) -> dict:
        """Whole 16-token blocks of the prompt, the last one from host RAM."""
        num_cached = (num_prompt_tokens - 1) // 16 * 16
        on_host = 16 if num_cached >= 32 else 0
        tiers = {"device": num_cached - on_host, "host": on_host}
        return {"num_cached_tokens": num_cached,
                "cached_tokens_by_tier": {t: n for t, n in tiers.items() if n}}


class ThreadedServer:
    def __init__(self, engine: FakeEngineClient, options: ServerOptions = ServerOptions()) -> None:
        self.engine = engine
        self.options = options
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None

    def start(self) -> None:
        self._call(self._start())

    def stop(self) -> None:
        if self.runner is not None:
            self._call(self.runner.cleanup())
            self.runner = None

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _start(self) -> None:
        state = AppState(self.engine, FakeRecipe(), self.options)
        self.runner = web.AppRunner(build_app(state), handler_cancellation=True,
                                    shutdown_timeout=2.0, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

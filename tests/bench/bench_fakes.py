"""A fake OpenAI streaming chat server for the benchmark tests (no model).

It runs on 127.0.0.1 in its own thread and event loop, so both the synchronous CLI (which runs
its own loop) and async tests can drive it. The request's `model` field picks the behaviour:

    ok            role chunk, then one chunk per reply word (with `duplex` draft counts), usage
    no-usage      as ok, without usage
    slow          as ok, 50 ms between chunks
    crlf          as ok, CRLF line ends, SSE comments and a multi-line data event
    http400/429/500/503   that status with a JSON error body
    malformed     a data line that is not JSON
    truncated     one content chunk, then the stream closes without [DONE]
    stream-error  an `error` object inside the stream
    hang          never answers
    hang-mid      sends headers and one chunk, then never finishes
"""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

PROMPT_TOKENS = 100
CACHED_TOKENS = 25
DRAFT_PROPOSED, DRAFT_ACCEPTED = 2, 1


def reply_words(messages: list[dict]) -> list[str]:
    """The fake model's reply: a function of the request so tests can predict histories."""
    return ["reply", f"to-{len(messages)}-messages", "done"]


class FakeOpenAI:
    def __init__(self, chunk_delay_s: float = 0.005):
        self.chunk_delay_s = chunk_delay_s
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def start(self) -> "FakeOpenAI":
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        except Exception:  # noqa: BLE001 — a hung handler must not hang the test session
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _serve(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        mode = body.get("model", "ok")
        if mode.startswith("http"):
            status = int(mode[4:])
            return web.json_response({"error": {"message": f"fake {status}"}}, status=status,
                                     headers={"Retry-After": "1"} if status in (429, 503) else {})
        if mode == "hang":
            await asyncio.sleep(3600)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await self._events(response, mode, body)
        return response

    async def _events(self, response: web.StreamResponse, mode: str, body: dict) -> None:
        end = b"\r\n" if mode == "crlf" else b"\n"

        async def send(data: str) -> None:
            await response.write(b"data: " + data.encode() + end + end)

        if mode == "malformed":
            await send("{this is not json")
            return
        if mode == "stream-error":
            await send(json.dumps({"error": {"message": "engine died"}}))
            return
        await send(json.dumps(_chunk({"role": "assistant", "content": ""})))
        words = reply_words(body["messages"])
        for i, word in enumerate(words):
            await asyncio.sleep(0.05 if mode == "slow" else self.chunk_delay_s)
            chunk = _chunk({"content": word if i == 0 else " " + word})
            chunk["duplex"] = {"draft_proposed": DRAFT_PROPOSED, "draft_accepted": DRAFT_ACCEPTED}
            if mode == "crlf" and i == 0:
                await response.write(b": keep-alive comment" + end)
            await send(json.dumps(chunk))
            if mode == "truncated":
                return
            if mode == "hang-mid":
                await asyncio.sleep(3600)
        await send(json.dumps(_chunk({}, "stop")))
        if mode != "no-usage":
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(words),
                     "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}}
            text = json.dumps({"choices": [], "usage": usage}, indent=1)
            if mode == "crlf":              # one event spread over several data lines
                lines = text.split("\n")
                await response.write(b"".join(b"data: " + ln.encode() + end for ln in lines)
                                     + end)
            else:
                await send(json.dumps({"choices": [], "usage": usage}))
        await send("[DONE]")


def _chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

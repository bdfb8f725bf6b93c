"""Structured-output test support: a real EngineCore behind the frontend, in one process.

`CoreEngine` is the engine client the API server talks to (the same `generate` contract as
frontend/engine_client.py), stepping a real EngineCore on its own thread; `ApiServer` runs
the real app (real recipe, real tokenizer) on a 127.0.0.1 port on a loop thread, so the
official SDKs can call it. No worker process, no ZeroMQ: those are tested elsewhere.
"""
from __future__ import annotations

import asyncio
import threading
import time

from duplex.engine.core import EngineCore
from duplex.engine.messages import AddRequest, Ready, RequestDelta
from duplex.frontend.server import AppState, ServerOptions, build_app


class CoreEngine:
    """An in-process engine client over one EngineCore, stepped on a daemon thread."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.ready = True
        self.ready_info = Ready(worker_id="core", role="unified", model_name=core.model_name,
                                max_model_len=core.max_model_len, block_size=core.block_size,
                                num_kv_blocks=core.num_kv_blocks)
        self.added: list[AddRequest] = []
        self._lock = threading.Lock()
        self._inbox: list = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._closed = False
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self):
        return None

    def workers(self) -> dict:
        return {"core": self.ready_info}

    def worker_stats(self) -> dict:
        return {}

    async def generate(self, msg: AddRequest):
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._streams[msg.req_id] = (asyncio.get_running_loop(), queue)
        self.added.append(msg)
        self._post(("add", msg))
        done = False
        try:
            while not done:
                delta = await queue.get()
                done = delta.finish_reason is not None
                yield delta
        finally:
            self._streams.pop(msg.req_id, None)
            if not done:
                self._post(("abort", msg.req_id))

    async def abort(self, req_id: str) -> None:
        self._post(("abort", req_id))

    async def close(self) -> None:
        self.close_now()

    def close_now(self) -> None:
        self._closed = True
        self._wake.set()

    def _post(self, item) -> None:
        with self._lock:
            self._inbox.append(item)
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for kind, value in inbox:
                if kind == "add":
                    try:
                        self.core.add_request(value)
                    except ValueError as e:
                        self._deliver(RequestDelta(value.req_id, [], finish_reason="error",
                                                   error=str(e)))
                else:
                    self.core.abort_requests([value])
            if not self.core.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for delta in self.core.step():
                self._deliver(delta)

    def _deliver(self, delta: RequestDelta) -> None:
        stream = self._streams.get(delta.req_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, delta)


class ApiServer:
    """The real app over `engine` and `recipe` on its own loop thread."""

    def __init__(self, engine, recipe, **options) -> None:
        self.engine = engine
        self.recipe = recipe
        self.options = ServerOptions(web_dir=None, **options)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._runner = None
        self.port = 0
        self._call(self._start())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        from aiohttp import web

        state = AppState(self.engine, self.recipe, self.options)
        self._runner = web.AppRunner(build_app(state), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def close_app(self) -> None:
        """Stop serving; the engine keeps running (other apps may share it)."""
        if self._runner is not None:
            self._call(self._runner.cleanup())
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)

    def close(self) -> None:
        self.close_app()
        self.engine.close_now()
        time.sleep(0.05)

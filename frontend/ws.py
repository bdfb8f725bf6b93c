"""WebSocket API at GET /v1/ws: many concurrent chat requests on one socket, told apart by id.

Client frames (JSON text): `chat` (id, messages, sampling fields), `cancel` (id), `ping`.
Server frames: `delta` per engine step (`text` the answer, `reasoning` the thinking block when
a reasoning parser is on), then exactly one terminal frame per request,
`done` (finish reason, usage with cached tokens by tier, timings) or `error` (code,
message; code "cancelled" after a cancel). Each request runs in its own task; cancelling
it, or closing the socket, closes its pipeline and so aborts it on the worker. A chat frame
becomes an `Order` for the intake (frontend/intake.py) like every API's request: the same
model check (a wrong `model` is an invalid_request error frame), rendering, retention and
admission. Frame types are the msgspec structs in `protocol` (`ws_json_schema()` describes them).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import TYPE_CHECKING

import msgspec
from aiohttp import WSMsgType, web

from duplex.engine.text.messages import Chat
from duplex.frontend.auth import WS_PROTOCOL
from duplex.frontend.body_limits import check_depth
from duplex.frontend.errors import ApiError
from duplex.frontend.generation import Delta, Final, sampling_fields
from duplex.frontend.intake import ChatPrompt, Order
from duplex.frontend.openai_messages import chat_messages
from duplex.frontend.protocol import (WsCancel, WsChat, WsClientFrame, WsDelta, WsDone, WsError,
                                      WsPing, WsPong, WsTimings, WsUsage, REQ_ID, decode_json,
                                      encode)

if TYPE_CHECKING:
    from duplex.frontend.app_state import AppState

log = logging.getLogger("duplex.ws")

HEARTBEAT_S = 30.0
MAX_REQUESTS_PER_SOCKET = 64
# error kinds the frame protocol words its own way (docs/websocket.md lists every code)
_CODES = {"not_found": "invalid_request"}  # a model this server does not serve


class WebSocketApi:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self._sessions: weakref.WeakSet[_Session] = weakref.WeakSet()

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/ws", self.handle)]

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse(heartbeat=HEARTBEAT_S, protocols=(WS_PROTOCOL,),
                                       max_msg_size=self.state.options.client_max_size)
        await socket.prepare(request)
        session = _Session(self.state, request, socket)
        self._sessions.add(session)
        try:
            async for message in socket:
                if message.type == WSMsgType.TEXT:
                    await session.on_text(message.data)
                elif message.type == WSMsgType.BINARY:
                    await session.send(WsError(None, "invalid_request",
                                               "binary frames are not supported; send JSON text"))
                elif message.type == WSMsgType.ERROR:
                    break
        finally:
            await session.close()
        return socket

    async def close_all(self, _app: web.Application | None = None) -> None:
        """On shutdown: abort every socket's requests and close the sockets."""
        for session in list(self._sessions):
            await session.close()
            await session.socket.close(code=1001, message=b"server shutting down")


class _Session:
    """One socket: owns the tasks of its requests, keyed by the client's ids."""

    def __init__(self, state: AppState, request: web.Request, socket: web.WebSocketResponse):
        self.state = state
        self.request = request
        self.socket = socket
        self.tasks: dict[str, asyncio.Task] = {}
        self._send_lock = asyncio.Lock()
        self._num_requests = 0

    async def on_text(self, text: str) -> None:
        """One client frame; whatever it holds, a bad one gets an error frame for itself
        only, and the socket's other requests go on."""
        try:
            frame = await self.state.cpu.run(len(text), decode_json, text, WsClientFrame)
        except ApiError as e:
            await self.send(WsError(_client_id(text), e.kind, e.message))
            return
        except Exception:  # noqa: BLE001 - a decoder bug must not close the socket
            log.exception("websocket frame failed to decode")
            await self.send(WsError(None, "invalid_request", "the frame cannot be decoded"))
            return
        if isinstance(frame, WsPing):
            await self.send(WsPong())
        elif isinstance(frame, WsCancel):
            await self.cancel(frame.id)
        else:
            await self.start(frame, len(text))

    async def start(self, frame: WsChat, size: int = 0) -> None:
        if frame.id in self.tasks:
            await self.send(WsError(frame.id, "invalid_request",
                                    f"a request with id {frame.id!r} is already running"))
            return
        if len(self.tasks) >= MAX_REQUESTS_PER_SOCKET:
            await self.send(WsError(frame.id, "overloaded",
                                    f"at most {MAX_REQUESTS_PER_SOCKET} requests per socket"))
            return
        self._num_requests += 1
        req_id = f"ws-{self.request[REQ_ID]}-{self._num_requests}"
        self.tasks[frame.id] = asyncio.create_task(self._run(frame, req_id, size))

    async def cancel(self, client_id: str) -> None:
        """Cancel a running request; an unknown id (maybe just finished) is ignored."""
        task = self.tasks.pop(client_id, None)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.send(WsError(client_id, "cancelled", "cancelled by the client"))

    async def close(self) -> None:
        tasks, self.tasks = list(self.tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def send(self, frame) -> None:
        if self.socket.closed:
            return
        async with self._send_lock:
            with contextlib.suppress(ConnectionResetError):
                await self.socket.send_frame(encode(frame), WSMsgType.TEXT)  # JSON is UTF-8

    # ------------------------------------------------------------ one request
    async def _run(self, frame: WsChat, req_id: str, size: int) -> None:
        try:
            with self.state.intake.admit() as ticket:
                started = await self.state.intake.start(ticket, self.request, size, _order,
                                                        frame, req_id)
                async with contextlib.aclosing(started.events) as events:
                    async for event in events:
                        if isinstance(event, Final):  # terminal: a cancel can no longer race
                            self._forget(frame.id)
                        await self.send(self._frame(frame.id, event))
        except ApiError as e:
            self._forget(frame.id)
            await self.send(WsError(frame.id, _CODES.get(e.kind, e.kind), e.message))
        except Exception:  # noqa: BLE001 - a bug ends this request, not the socket
            log.exception("websocket request failed req_id=%s", req_id)
            self._forget(frame.id)
            await self.send(WsError(frame.id, "internal", "internal server error"))

    def _forget(self, client_id: str) -> None:
        """Drop the calling task's entry (not a newer request that reuses the id)."""
        if self.tasks.get(client_id) is asyncio.current_task():
            del self.tasks[client_id]

    def _frame(self, client_id: str, event: Delta | Final):
        if isinstance(event, Delta):
            return WsDelta(client_id, event.text, len(event.token_ids), event.num_draft_proposed,
                           event.num_draft_accepted, event.accepted_mask, event.reasoning)
        if event.failed:
            error = event.api_error()
            return WsError(client_id, error.kind, error.message)
        usage, timings = event.usage, event.timings
        info = self.state.engine.ready_info
        return WsDone(client_id, event.finish_reason,
                      WsUsage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
                              usage.cached_tokens, dict(usage.cached_by_tier),
                              usage.reasoning_tokens),
                      WsTimings(timings.ttft_s, timings.tokens_per_s, timings.e2e_s),
                      batch_invariant=bool(info and info.batch_invariant))


def _order(frame: WsChat, req_id: str) -> Order:
    """The intake's order of a chat frame (retention and tenant from the upgrade request)."""
    prompt = ChatPrompt(Chat(chat_messages(frame.messages)),
                        template_kwargs=frame.chat_template_kwargs, effort=frame.reasoning_effort)
    return Order(req_id=req_id, model=frame.model, prompt=prompt, sampling=sampling_fields(frame),
                 max_tokens=frame.max_tokens, thinking_budget=frame.thinking_budget,
                 reasoning_effort=frame.reasoning_effort, retention=frame.retention,
                 cache_salt=frame.cache_salt)


def _client_id(text: str) -> str | None:
    """The id of a frame that failed validation, if it has one, for the error frame."""
    try:
        check_depth(text)
        value = msgspec.json.decode(text)
    except (ValueError, RecursionError, MemoryError):  # DecodeError and TooDeep included
        return None
    client_id = value.get("id") if isinstance(value, dict) else None
    return client_id if isinstance(client_id, str) else None


"""Typed message queues over ZeroMQ: the only module of ours that touches a socket.

One frontend binds a ROUTER; each worker connects a DEALER whose routing id is its worker id.
For the prefill/decode split, each decode worker also binds a ROUTER for KV (`kv_server_
channel`) and prefill workers connect a DEALER to it (`kv_client_channel`): KV bytes go from
prefill to decode directly, never through the frontend.
A message on the wire is a list of frames:

    [routing id]   ROUTER side only: added on send, stripped on receive by zmq itself
    header         one msgspec-encoded message from `engine.messages` (tag first)
    *raw           extra raw byte frames (KV tensors), sent and received without copying

A frame that is not one of our messages (oversized, garbled, pickle, unknown tag, wrong field
types, unexpected extra frames) is rejected with a log line and a counter; receiving never
raises on bad input, so a hostile peer cannot crash the loop that reads from it.

With `keys` (engine.curve: `--worker-key`), every channel speaks CURVE: the bound side admits
only peers holding the deployment's key (a ZAP handler per context), and its ROUTER keeps a
routing id with the first connection that holds it (no ROUTER_HANDOVER; a dead peer's pipe is
closed by ZMQ heartbeats instead), so no peer can take over a live worker's id. Without keys
the sockets are plain, as on the default private IPC path.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from duplex.engine import curve
from duplex.engine.messages import (MAX_FRAME_BYTES, BadFrame, decode_from_decode_kv,
                             decode_from_worker, decode_to_decode_kv, decode_to_worker, encode)

log = logging.getLogger(__name__)

Decode = Callable[[Any], msgspec.Struct]
RawFrame = bytes | memoryview | zmq.Frame

# Log the first rejections in full, then one line per this many, so a flood cannot fill disks.
_LOG_EVERY = 1000
_LOG_FIRST = 20
# With CURVE (no handover): a silent peer's pipe closes after this, freeing its routing id.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 5000


class Received(NamedTuple):
    msg: msgspec.Struct
    raw_frames: list[zmq.Frame]  # zero-copy; valid as long as the caller holds them
    peer: bytes  # routing id of the sender (ROUTER side), b"" on a DEALER


class MessageReceiver:
    """Reads messages of one direction from a socket. Owns the rejection counters."""

    def __init__(self, socket: zmq.asyncio.Socket, decode: Decode, *,
                 max_frame_bytes: int = MAX_FRAME_BYTES, max_raw_frames: int = 0) -> None:
        self._socket = socket
        self._decode = decode
        self._is_routed = socket.type == zmq.ROUTER
        self._max_frame_bytes = max_frame_bytes
        self._max_raw_frames = max_raw_frames
        self.num_received = 0
        self.num_rejected = 0

    async def get(self) -> Received:
        """Wait for the next well-formed message; bad ones are counted, logged and skipped."""
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            self.num_received += 1
            try:
                return self._parse(frames)
            except BadFrame as e:
                self._reject(frames, e)

    def _parse(self, frames: list[zmq.Frame]) -> Received:
        peer = frames.pop(0).bytes if self._is_routed and frames else b""
        if not frames:
            raise BadFrame("message without a header frame")
        header, raw_frames = frames[0], frames[1:]
        if len(raw_frames) > self._max_raw_frames:
            raise BadFrame(f"{len(raw_frames)} raw frames, at most {self._max_raw_frames} allowed")
        if len(header) > self._max_frame_bytes:
            raise BadFrame(f"header of {len(header)} bytes exceeds {self._max_frame_bytes}")
        return Received(self._decode(header.buffer), raw_frames, peer)

    def _reject(self, frames: list[zmq.Frame], error: BadFrame) -> None:
        self.num_rejected += 1
        if self.num_rejected <= _LOG_FIRST or self.num_rejected % _LOG_EVERY == 0:
            log.warning("rejected frame #%d (%d frames): %s", self.num_rejected, len(frames), error)


class MessageSender:
    """Writes messages to a socket. After `put` returns, zmq owns the raw frames: the caller
    must not modify their memory until the peer has them (they are sent without copying)."""

    def __init__(self, socket: zmq.asyncio.Socket) -> None:
        self._socket = socket
        self._is_routed = socket.type == zmq.ROUTER
        self.num_sent = 0

    async def put(self, msg: msgspec.Struct, *, raw_frames: Sequence[RawFrame] = (),
                  peer: bytes = b"") -> None:
        """Send one message. On a ROUTER, `peer` names the worker; an unknown or disconnected
        peer raises zmq.ZMQError (EHOSTUNREACH) at once instead of dropping silently."""
        head = [peer] if self._is_routed else []
        await self._socket.send_multipart([*head, encode(msg), *raw_frames], copy=False)
        self.num_sent += 1


class Channel:
    """One socket with its typed sender and receiver."""

    def __init__(self, socket: zmq.asyncio.Socket, decode: Decode, *,
                 watch_handshakes: bool = False, zap: "_Zap | None" = None,
                 **limits: int) -> None:
        self.socket = socket
        self.sender = MessageSender(socket)
        self.receiver = MessageReceiver(socket, decode, **limits)
        self._zap = zap
        # Made before the socket connects, so that the first handshake is seen too.
        self._monitor = (socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                         if watch_handshakes else None)

    async def handshakes(self) -> AsyncIterator[str]:
        """Yield the peer endpoint each time a connection completes its handshake: the first
        connect and every reconnect (the peer may be a restarted process)."""
        assert self._monitor is not None, "channel made without watch_handshakes=True"
        while True:
            event = await recv_monitor_message(self._monitor)
            yield event["endpoint"].decode(errors="replace")

    @property
    def address(self) -> str:
        """The endpoint actually bound or connected (a `tcp://host:*` bind resolves its port)."""
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; with linger > 0, queued messages get that long to leave first."""
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
        self.socket.close(linger=linger_ms)
        if self._zap is not None:
            self._zap.release()
            self._zap = None


class _Zap:
    """The ZAP handler of one context, shared by its CURVE server sockets (ZeroMQ allows
    one per context); stopped when the last of them closes."""

    _by_context: dict[int, "_Zap"] = {}

    def __init__(self, ctx: zmq.Context, keys: curve.CurveKeys) -> None:
        self._ctx_id, self.keys, self.num_users = id(ctx.underlying), keys, 0
        self._auth = curve.authenticator(ctx, keys)

    @classmethod
    def acquire(cls, ctx: zmq.Context, keys: curve.CurveKeys) -> "_Zap":
        zap = cls._by_context.get(id(ctx.underlying))
        if zap is None:
            zap = cls._by_context[id(ctx.underlying)] = cls(ctx, keys)
        if zap.keys != keys:
            raise ValueError("one ZeroMQ context serves one deployment key")
        zap.num_users += 1
        return zap

    def release(self) -> None:
        self.num_users -= 1
        if self.num_users == 0:
            self._by_context.pop(self._ctx_id, None)
            self._auth.stop()


class _Context(zmq.asyncio.Context):
    """pyzmq's context, terminated off the collecting thread when left to the garbage collector.

    pyzmq's finalizer closes the sockets the context still knows (a weak set) and then terms
    it, which waits until every socket is closed. A context collected in one garbage cycle
    with its sockets knows none of them (weak references are cleared before finalizers run),
    so `term` waited forever, on whatever thread collected (an event loop: a test run hung
    there), for sockets the same collection would close next. Here `term` runs on a daemon
    thread and ends once they are closed."""

    def __del__(self) -> None:
        # as pyzmq: nothing at interpreter exit (its atexit hook sets `_exiting`)
        if not self._shadow and not self.closed and not zmq.sugar.context._exiting:
            threading.Thread(target=self.term, name="zmq-term", daemon=True).start()


def new_context() -> zmq.asyncio.Context:
    """A context whose sockets default to LINGER 0, so that neither `term` nor a context
    left to the garbage collector (`_Context`) can wait forever on messages queued for a
    peer that is gone; a socket that should flush on close says so there
    (`Channel.close(linger_ms=...)`)."""
    ctx = _Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def _secure_router(ctx: zmq.asyncio.Context, socket: zmq.asyncio.Socket,
                   keys: curve.CurveKeys | None) -> "_Zap | None":
    """ROUTER options before bind: plain (handover on, for fast restarts on the local path),
    or CURVE with the ZAP handler and no handover."""
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if keys is None:
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        return None
    socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    zap = _Zap.acquire(ctx, keys)
    curve.make_server(socket, keys)
    return zap


def _secure_dealer(socket: zmq.asyncio.Socket, keys: curve.CurveKeys | None) -> None:
    if keys is not None:
        socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        curve.make_client(socket, keys)


def worker_channel(ctx: zmq.asyncio.Context, address: str, worker_id: str,
                   keys: curve.CurveKeys | None = None, **limits: int) -> Channel:
    """The worker's side: a DEALER that connects to the frontend and reconnects on its own
    (`handshakes()` tells when). Messages sent while disconnected wait in its queue."""
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, worker_id.encode())
    _secure_dealer(socket, keys)
    channel = Channel(socket, decode_to_worker, watch_handshakes=True, **limits)
    socket.connect(address)
    return channel


def frontend_channel(ctx: zmq.asyncio.Context, address: str,
                     keys: curve.CurveKeys | None = None, **limits: int) -> Channel:
    """The frontend's side: a ROUTER bound at `address`, to which workers connect.

    ROUTER_MANDATORY makes a send to an absent worker fail loudly; without keys,
    ROUTER_HANDOVER lets a restarted worker take over its routing id from a connection not
    yet seen as closed."""
    socket = ctx.socket(zmq.ROUTER)
    zap = _secure_router(ctx, socket, keys)
    socket.bind(address)
    return Channel(socket, decode_from_worker, zap=zap, **limits)


def kv_server_channel(ctx: zmq.asyncio.Context, address: str, *, max_raw_frames: int,
                      keys: curve.CurveKeys | None = None, **limits: int) -> Channel:
    """A decode worker's KV door: a ROUTER bound at `address` (`tcp://127.0.0.1:*` picks a
    free port; `address` of the channel tells which), to which prefill workers connect."""
    socket = ctx.socket(zmq.ROUTER)
    zap = _secure_router(ctx, socket, keys)
    socket.bind(address)
    return Channel(socket, decode_to_decode_kv, zap=zap, max_raw_frames=max_raw_frames,
                   **limits)


def kv_client_channel(ctx: zmq.asyncio.Context, address: str, worker_id: str,
                      keys: curve.CurveKeys | None = None) -> Channel:
    """A prefill worker's link to one decode worker's KV door (a DEALER, routing id =
    the prefill worker's id, so the decode worker can answer it)."""
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, worker_id.encode())
    socket.setsockopt(zmq.LINGER, 0)
    _secure_dealer(socket, keys)
    channel = Channel(socket, decode_from_decode_kv)
    socket.connect(address)
    return channel

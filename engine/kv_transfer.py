"""KV hand-off of the prefill/decode split: `KVSender` on prefill workers, `KVIntake` on decode
workers. Each owns the hand-offs in flight on its side; the worker calls them between steps.

Who binds what (KV bytes never pass through the frontend, which would copy every block twice
on the box that also serves HTTP):

    frontend ROUTER        <── DEALER  every worker             requests, tokens, HandoffFailed
    decode worker ROUTER   <── DEALER  each prefill worker      KV  (`kv_address` in Ready)

One request, P = prefill worker, D = its decode worker (named by the router in AddRequest):

    P admits it   ──KvOffer(request, prompt block keys)────────▶ D  derives the keys itself,
    P             ◀──KvNeed(indices D lacks) | KvReject─────────  D  looks up what it holds
    P each step   ──KvBlocks header + one raw frame per block──▶ D  checks, puts each block in
                    (blocks as their chunk completes, so the        its host tier by key
                     transfer overlaps the next chunk)
    P 1st token   ──KvDone(first token ids)─────────────────────▶ D  adds the request: its
    P             ◀──KvAck───────────────────────────────────────  D  scheduler finds the blocks
                                                                     as prefix hits (the tier
                                                                     load path, no other copy)
Ownership: from the first token until KvAck, KvReject or the lease ends (`lease_s`), P holds
a `KVLease` on the prompt's blocks (by key, from the KV manager's `KVHandoff`). Blocks are copied out at
send time (one gather per group), so P never sends memory a later step could overwrite. On
anything but KvAck, P cancels at D, frees the blocks and sends HandoffFailed to the frontend,
whose policy recomputes the request on a decode worker or fails it.

Both sides see the KV cache only through `engine.kv_manager.KVHandoff` (keys, leases, the
host tier) and read the runner's KV tensor; requests and reference counts stay the core's.

Only full blocks have keys, so D computes the prompt's last partial block and the first token
again (< block_size + 1 tokens). Everything D receives is validated against its own layout
and keys before it is stored; a bad header, size, index or key rejects the whole message.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import zmq
import zmq.asyncio

from duplex.engine.messages import (AddRequest, BadFrame, HandoffFailed, KvAck, KvBlocks, KvCancel,
                             KvDone, KvNeed, KvOffer, KvReject, FinishReason, RequestDelta)
from duplex.engine.config import HANDOFF_LEASE_S
from duplex.engine.curve import CurveKeys
from duplex.engine.kv_manager import KVHandoff, KVLease
from duplex.engine.zmq_io import Channel, kv_client_channel, kv_server_channel

log = logging.getLogger(__name__)

MAX_BLOCKS_PER_MESSAGE = 64
SEND_TIMEOUT_S = 2.0  # a KV send that cannot leave this fast fails the hand-off
INTAKE_TIMEOUT_S = 120.0  # an offer never completed is forgotten after this long
_NUM_ABORTED_KEPT = 4096
_LOG_FIRST, _LOG_EVERY = 20, 1000


class BlockLayout(NamedTuple):
    """One block of every layer as it travels: [layers, 2, block_size, kv_heads, row] (row:
    head_dim, or head_dim + 4 bytes for an int8 pool's packed rows, kernels.kv_store); the
    dtype and shape checks and the key namespaces (kv_format) keep pools of another
    precision apart."""
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, kv) -> BlockLayout:
        """kv: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
        return cls(str(kv.dtype).removeprefix("torch."), shape,
                   math.prod(shape) * kv.element_size())

    @property
    def block_size(self) -> int:
        return self.shape[2]


def export_blocks(kv, block_ids: list[int], platform=None) -> list[memoryview]:
    """Read-only: a contiguous copy of each block (all layers, K and V; the BlockEntry payload
    layout), one memoryview per block, ready to be sent without another copy."""
    if not block_ids:
        return []
    import torch  # here, so that workers on fake cores (tests) never load torch
    # one gather of every block, [n, layers, 2, block_size, kv_heads, head_dim] (contiguous),
    # then, from a device pool, one copy to the host (not one per block): into pinned
    # memory on the platform's copy stream when there is one
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
    out = kv.permute(2, 0, 1, 3, 4, 5).index_select(0, ids)
    out = platform.to_host(out) if platform is not None else out.cpu()
    rows = out.reshape(len(block_ids), -1).view(torch.uint8).numpy()
    return [memoryview(row) for row in rows]


def prefill_part(msg: AddRequest) -> AddRequest:
    """What a prefill worker runs of a request: the prompt and its first token only. Stop
    rules stay those of the whole request, so a first token that ends it still ends it."""
    params = msg.params
    changes = dict(max_tokens=1, min_tokens=min(params.min_tokens, 1))
    if params.min_tokens > 1:  # the first token cannot stop the request
        changes.update(ignore_eos=True, stop_token_ids=[])
    return msgspec.structs.replace(msg, params=msgspec.structs.replace(params, **changes))


# ================================================================ prefill side
class _Outgoing:
    """One request being handed off, as the prefill worker sees it."""

    def __init__(self, msg: AddRequest, keys: list[bytes]) -> None:
        self.msg = msg
        self.keys = keys  # of the prompt's full blocks
        self.is_offered = False
        self.need: list[int] | None = None  # block indices D asked for; None: no answer yet
        self.num_sent = 0  # need[:num_sent] are sent
        self.first_token_ids: list[int] | None = None  # set when the core is done with it
        self.lease = KVLease([])  # blocks held for D, index-aligned with keys
        self.is_done_sent = False
        self.lease_until = math.inf
        self.outcome: str | None = None  # "acked" or why it failed; settled between steps


class _Link:
    """A DEALER to one decode worker's KV door and the task reading its answers."""

    def __init__(self, channel: Channel, task: asyncio.Task) -> None:
        self.channel, self.task = channel, task

    def close(self) -> None:
        self.task.cancel()
        self.channel.close()


class KVSender:
    """Prefill side. The worker calls `start` on admission, `after_step` right after each step
    (same thread, before the next), `pump` between steps, `cancel` on aborts."""

    def __init__(self, kv: KVHandoff, kv_cache, max_model_len: int, ctx: zmq.asyncio.Context,
                 worker_id: str, *, wakeup: Callable[[], None],
                 lease_s: float = HANDOFF_LEASE_S, keys: CurveKeys | None = None,
                 platform=None) -> None:
        self._kv = kv
        self._kv_cache = kv_cache  # the runner's [layers, 2, blocks, slot, kv_head, head_dim]
        self._platform = platform  # engine.platform.Platform (pinned copies); None: .cpu()
        self._max_model_len = max_model_len
        self._ctx = ctx
        self._keys = keys  # CURVE keys of the deployment (engine.curve), None: plain
        self._worker_id = worker_id
        self._wakeup = wakeup
        self._lease_s = lease_s
        self._layout = BlockLayout.of(kv_cache)
        self._outgoing: dict[str, _Outgoing] = {}
        # req_id -> max tokens of the whole request, until its first token has passed: that
        # token is never final for the frontend, even when the hand-off failed already
        self._continuing: dict[str, int] = {}
        self._links: dict[str, _Link] = {}
        self.counters = dict.fromkeys(("handoffs", "acked", "failed", "blocks_sent",
                                       "bytes_sent"), 0)

    @property
    def has_work(self) -> bool:
        return bool(self._outgoing)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(h.lease.block_ids) for h in self._outgoing.values())

    # ------------------------------------------------------------------ the worker's hooks
    def start(self, msg: AddRequest) -> None:
        """`msg` (the whole request) was admitted to the core as `prefill_part(msg)`."""
        keys = self._kv.block_keys(msg.cache_salt, msg.prompt_token_ids)
        room = self._max_model_len - len(msg.prompt_token_ids)
        self._outgoing[msg.req_id] = _Outgoing(msg, keys)
        self._continuing[msg.req_id] = _max_tokens(msg, room)
        self.counters["handoffs"] += 1

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Deltas as the frontend must see them: the first token of a request that continues
        on its decode worker is not final. Pins that request's blocks (the core just freed
        them) before any other step can reuse them."""
        out = []
        for delta in deltas:
            max_tokens = self._continuing.get(delta.req_id)
            if max_tokens is None or delta.finish_reason is None:
                out.append(delta)
                continue
            del self._continuing[delta.req_id]
            h = self._outgoing.get(delta.req_id)
            is_live = h is not None and h.outcome is None
            if delta.finish_reason == FinishReason.LENGTH and len(delta.new_token_ids) < max_tokens:
                if is_live:
                    self._hold(h, delta.new_token_ids)
                out.append(msgspec.structs.replace(delta, finish_reason=None, stop_reason=None))
            else:  # it really ended here (stop token, max_tokens 1, error, abort)
                if is_live:
                    h.outcome = "ended on the prefill worker"
                out.append(delta)
        return out

    def cancel(self, req_ids: list[str]) -> None:
        """Aborted, or added again: free the held blocks now; the hand-off is cancelled at
        the decode worker, without a report to the frontend, in the next pump."""
        for req_id in req_ids:
            self._continuing.pop(req_id, None)
            h = self._outgoing.get(req_id)
            if h is not None and h.outcome is None:
                h.outcome = "aborted"
                self._release(h)  # between steps, like every call

    async def pump(self) -> list[HandoffFailed]:
        """Between steps: offers, blocks whose chunk completed, KvDone, settled hand-offs;
        the failures to report to the frontend."""
        failures: list[HandoffFailed] = []
        now = time.monotonic()
        for h in list(self._outgoing.values()):
            if h.outcome is None and now >= h.lease_until:
                h.outcome = f"no acknowledgement within the {self._lease_s:g} s lease"
            if h.outcome is None:
                try:
                    await self._advance(h)
                except (zmq.ZMQError, TimeoutError) as e:
                    h.outcome = f"decode worker unreachable: {e or type(e).__name__}"
            if h.outcome is not None:
                failure = await self._settle(h)
                if failure is not None:
                    failures.append(failure)
        return failures

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()

    # ------------------------------------------------------------------ one hand-off
    def _hold(self, h: _Outgoing, token_ids: list[int]) -> None:
        """The core is done with the request: lease its prompt blocks by key (up to the
        first one no longer cached: D computes it and what follows)."""
        h.lease = self._kv.lease(h.keys)
        h.first_token_ids = list(token_ids)
        h.lease_until = time.monotonic() + self._lease_s

    async def _advance(self, h: _Outgoing) -> None:
        link = self._link(h.msg.handoff_address)
        if not h.is_offered:
            await self._send(link, KvOffer(h.msg.req_id, _for_decode(h.msg), h.keys,
                                           self._layout.dtype, list(self._layout.shape)))
            h.is_offered = True
        if h.need is None:
            return
        block_ids = self._available_blocks(h)
        todo = []
        for index in h.need[h.num_sent:]:
            if index >= len(block_ids):
                break
            todo.append(index)
        for start in range(0, len(todo), MAX_BLOCKS_PER_MESSAGE):
            await self._send_blocks(link, h, todo[start:start + MAX_BLOCKS_PER_MESSAGE],
                                    block_ids)
        h.num_sent += len(todo)
        if h.first_token_ids is not None and not h.is_done_sent:
            h.num_sent = len(h.need)  # blocks no longer cached here are computed on D
            await self._send(link, KvDone(h.msg.req_id, h.first_token_ids, h.num_sent))
            h.is_done_sent = True

    def _available_blocks(self, h: _Outgoing) -> list[int]:
        """Block ids of the leading prompt blocks whose KV is complete now (the core
        publishes each full block as its chunk completes)."""
        if h.first_token_ids is not None:
            return h.lease.block_ids
        return self._kv.computed_prefix(h.keys)

    async def _send_blocks(self, link: _Link, h: _Outgoing, indices: list[int],
                           block_ids: list[int]) -> None:
        frames = export_blocks(self._kv_cache, [block_ids[i] for i in indices], self._platform)
        layout = self._layout
        header = KvBlocks(h.msg.req_id, indices, [h.keys[i] for i in indices], layout.dtype,
                          list(layout.shape), layout.block_size)
        await self._send(link, header, frames)
        self.counters["blocks_sent"] += len(indices)
        self.counters["bytes_sent"] += len(indices) * layout.nbytes

    async def _settle(self, h: _Outgoing) -> HandoffFailed | None:
        """Free the held blocks and forget the hand-off; a failure becomes a report."""
        del self._outgoing[h.msg.req_id]
        self._release(h)
        if h.outcome == "acked":
            self.counters["acked"] += 1
            return None
        link = self._links.get(h.msg.handoff_address)
        if link is not None and h.is_offered:
            try:
                await self._send(link, KvCancel(h.msg.req_id, h.outcome))
            except (zmq.ZMQError, TimeoutError):
                pass
        if h.outcome in ("aborted", "ended on the prefill worker"):
            return None
        if not any(o.msg.handoff_address == h.msg.handoff_address
                   for o in self._outgoing.values()):
            self._close_link(h.msg.handoff_address)  # a new connection for the next one
        self.counters["failed"] += 1
        log.warning("hand-off of %s to %s failed: %s", h.msg.req_id, h.msg.handoff_to,
                    h.outcome)
        return HandoffFailed(self._worker_id, h.msg.req_id, h.msg.handoff_to, h.outcome)

    def _release(self, h: _Outgoing) -> None:
        self._kv.release(h.lease)
        h.lease = KVLease([])

    # ------------------------------------------------------------------ links
    def _link(self, address: str) -> _Link:
        link = self._links.get(address)
        if link is None:
            channel = kv_client_channel(self._ctx, address, self._worker_id, self._keys)
            link = _Link(channel, asyncio.ensure_future(self._receive_forever(address,
                                                                              channel)))
            self._links[address] = link
        return link

    def _close_link(self, address: str) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.close()

    async def _send(self, link: _Link, msg: msgspec.Struct, frames=()) -> None:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await link.channel.sender.put(msg, raw_frames=frames)

    async def _receive_forever(self, address: str, channel: Channel) -> None:
        while True:
            msg = (await channel.receiver.get()).msg
            h = self._outgoing.get(msg.req_id)
            if h is None or h.msg.handoff_address != address or h.outcome is not None:
                continue
            match msg:
                case KvNeed(indices=indices) if h.need is None:
                    h.need = sorted({i for i in indices if 0 <= i < len(h.keys)})
                case KvAck():
                    h.outcome = "acked"
                case KvReject(reason=reason):
                    h.outcome = f"refused by the decode worker: {reason}"
            self._wakeup()


def _max_tokens(msg: AddRequest, room: int) -> int:
    """Tokens the whole request may generate: its max_tokens clipped to the room left in
    the context."""
    return room if msg.params.max_tokens is None else min(room, msg.params.max_tokens)


def _for_decode(msg: AddRequest) -> AddRequest:
    return msgspec.structs.replace(msg, handoff_to="", handoff_address="")


# ================================================================ decode side
class _Incoming:
    """One request being received, as the decode worker sees it."""

    def __init__(self, peer: bytes, offer: KvOffer, keys: list[bytes]) -> None:
        self.peer = peer
        self.offer = offer
        self.keys = keys  # derived here, equal to the offer's
        self.expires = time.monotonic() + INTAKE_TIMEOUT_S


class KVIntake:
    """Decode side: binds the KV door, validates and stores blocks, and hands a completed
    request to the worker through `deliver`; the worker calls `accepted` once it runs it."""

    def __init__(self, kv: KVHandoff, kv_cache, ctx: zmq.asyncio.Context, address: str, *,
                 deliver: Callable[[AddRequest], None],
                 is_live: Callable[[str], bool], keys: CurveKeys | None = None) -> None:
        self._kv = kv
        self._deliver = deliver
        self._is_live = is_live
        self._layout = BlockLayout.of(kv_cache)
        self._channel = kv_server_channel(ctx, address, max_raw_frames=MAX_BLOCKS_PER_MESSAGE,
                                          keys=keys)
        self.address = self._channel.address
        self._incoming: dict[str, _Incoming] = {}
        self._delivered: dict[str, bytes] = {}  # req_id -> peer awaiting KvAck
        self._replies: list[tuple[bytes, msgspec.Struct]] = []
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self.counters = dict.fromkeys(("offers", "blocks_received", "continued",
                                       "rejected_messages"), 0)

    @property
    def num_rejected(self) -> int:
        return self.counters["rejected_messages"] + self._channel.receiver.num_rejected

    # ------------------------------------------------------------------ the worker's hooks
    async def serve_forever(self) -> None:
        while True:
            msg, frames, peer = await self._channel.receiver.get()
            try:
                self._handle(msg, frames, peer)
            except BadFrame as e:
                self._reject(msg, e)
            await self.flush()

    def accepted(self, req_id: str) -> None:
        """The worker runs the delivered request now: acknowledge to the prefill worker."""
        peer = self._delivered.pop(req_id, None)
        if peer is not None:
            self._replies.append((peer, KvAck(req_id)))
            self.counters["continued"] += 1

    def refused(self, req_id: str, reason: str) -> None:
        """The worker could not run the delivered request: the prefill side may free."""
        peer = self._delivered.pop(req_id, None)
        if peer is not None:
            self._replies.append((peer, KvReject(req_id, reason)))

    def forget(self, req_ids: list[str]) -> None:
        """Aborted by the frontend: drop what is in flight and refuse later offers."""
        for req_id in req_ids:
            self._incoming.pop(req_id, None)
            self._aborted[req_id] = None
        while len(self._aborted) > _NUM_ABORTED_KEPT:
            self._aborted.popitem(last=False)

    async def flush(self) -> None:
        """Send queued answers (a prefill worker that left is skipped) and expire offers."""
        replies, self._replies = self._replies, []
        for peer, reply in replies:
            try:
                await self._channel.sender.put(reply, peer=peer)
            except zmq.ZMQError as e:
                log.warning("cannot answer prefill worker %r: %s", peer, e)
        now = time.monotonic()
        for req_id in [r for r, inc in self._incoming.items() if inc.expires < now]:
            del self._incoming[req_id]

    def close(self) -> None:
        self._channel.close()

    # ------------------------------------------------------------------ messages
    def _handle(self, msg: msgspec.Struct, frames: list[zmq.Frame], peer: bytes) -> None:
        if frames and not isinstance(msg, KvBlocks):
            raise BadFrame(f"{type(msg).__name__} with {len(frames)} raw frames")
        match msg:
            case KvOffer():
                self.counters["offers"] += 1
                self._replies.append((peer, self._on_offer(msg, peer)))
            case KvBlocks() | KvDone() | KvCancel() if msg.req_id in self._aborted:
                pass  # the frontend aborted it while it was on its way
            case KvBlocks():
                self._on_blocks(msg, frames, self._incoming_of(msg.req_id, peer))
            case KvDone():
                self._on_done(msg, self._incoming_of(msg.req_id, peer))
            case KvCancel() if msg.req_id in self._delivered:
                pass  # too late: it runs here already (the ack crossed the cancel)
            case KvCancel():
                self._incoming_of(msg.req_id, peer)
                del self._incoming[msg.req_id]

    def _on_offer(self, offer: KvOffer, peer: bytes) -> KvNeed | KvReject:
        req_id = offer.req_id
        error = self._offer_error(offer)
        if error is not None:
            log.info("refused KV offer of %s from %r: %s", req_id, peer, error)
            return KvReject(req_id, error)
        self._incoming[req_id] = _Incoming(peer, offer, offer.keys)
        return KvNeed(req_id, list(range(self._kv.num_held(offer.keys), len(offer.keys))))

    def _offer_error(self, offer: KvOffer) -> str | None:
        req = offer.request
        if offer.req_id != req.req_id:
            return "request id differs from the offer's"
        if offer.req_id in self._aborted:
            return "aborted"
        if self._is_live(offer.req_id) or offer.req_id in self._incoming \
                or offer.req_id in self._delivered:
            return "already running here"
        if (offer.dtype, tuple(offer.block_shape)) != self._layout[:2]:
            return (f"KV layout {offer.dtype}{offer.block_shape} differs from "
                    f"{self._layout.dtype}{list(self._layout.shape)}")
        if not self._kv.can_receive:
            return "no host KV tier to receive blocks"
        try:
            keys = self._kv.block_keys(req.cache_salt, req.prompt_token_ids)
        except (ValueError, TypeError) as e:
            return f"bad request: {e}"
        if keys != offer.keys:
            return "block keys differ (another model, dtype or tenant namespace)"
        return None

    def _on_blocks(self, header: KvBlocks, frames: list[zmq.Frame], inc: _Incoming) -> None:
        layout = self._layout
        if (header.dtype, tuple(header.shape), header.num_tokens) != \
                (layout.dtype, layout.shape, layout.block_size):
            raise BadFrame(f"KvBlocks layout {header.dtype}{header.shape}x{header.num_tokens}"
                           f" is not {layout.dtype}{list(layout.shape)}")
        if not len(header.indices) == len(header.keys) == len(frames):
            raise BadFrame(f"KvBlocks with {len(header.indices)} indices, {len(header.keys)} "
                           f"keys and {len(frames)} frames")
        for index, key, frame in zip(header.indices, header.keys, frames):
            if not 0 <= index < len(inc.keys) or inc.keys[index] != key:
                raise BadFrame(f"KvBlocks: block {index} is not part of the offer")
            if len(frame) != layout.nbytes:
                raise BadFrame(f"KvBlocks: frame of {len(frame)} bytes, a block has "
                               f"{layout.nbytes}")
        retention = inc.offer.request.retention
        for key, frame in zip(header.keys, frames):
            self._kv.store(key, frame.buffer, retention)
        self.counters["blocks_received"] += len(frames)

    def _on_done(self, done: KvDone, inc: _Incoming) -> None:
        del self._incoming[done.req_id]
        request = msgspec.structs.replace(inc.offer.request,
                                          output_token_ids=list(done.first_token_ids))
        self._delivered[done.req_id] = inc.peer
        self._deliver(request)

    def _incoming_of(self, req_id: str, peer: bytes) -> _Incoming:
        inc = self._incoming.get(req_id)
        if inc is None or inc.peer != peer:
            raise BadFrame(f"KV message for {req_id!r}, which {peer!r} has not offered")
        return inc

    def _reject(self, msg: msgspec.Struct, error: BadFrame) -> None:
        self.counters["rejected_messages"] += 1
        num = self.counters["rejected_messages"]
        if num <= _LOG_FIRST or num % _LOG_EVERY == 0:
            log.warning("rejected KV message #%d (%s): %s", num, type(msg).__name__, error)

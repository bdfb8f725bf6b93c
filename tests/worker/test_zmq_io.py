"""duplex.engine.zmq_io: typed queues round-trip messages and raw frames; hostile frames are counted,
logged and skipped, never raised."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq.asyncio

from duplex.engine.messages import (AbortRequests, Heartbeat, Outputs, Ready, RequestDelta, Shutdown,
                             WorkerStats, encode)
from duplex.engine.zmq_io import frontend_channel, worker_channel

from .conftest import add_request

# What pickle.dumps({"a": 1}) produces (written out: nothing here imports pickle).
PICKLED_DICT = b"\x80\x04\x95\n\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s."
READY = Ready("w0", "unified", "fake", 256, 16, 64)

HOSTILE_TO_WORKER = {
    "garbage": [b"\x00\xffnot msgpack at all"],
    "empty": [b""],
    "pickle": [PICKLED_DICT],
    "oversized": [encode(Shutdown()) + b"\x00" * 2048],
    "unknown tag": [msgspec.msgpack.encode(["launch_missiles", 1])],
    "wrong field types": [msgspec.msgpack.encode(["add", 123, "not a list", {}])],
    "wrong direction": [encode(READY)],
    "unexpected raw frame": [encode(AbortRequests(["a"])), b"raw"],
}


@pytest.fixture
async def pair(tmp_path):
    ctx = zmq.asyncio.Context()
    frontend = frontend_channel(ctx, f"ipc://{tmp_path}/io.ipc", max_raw_frames=2)
    worker = worker_channel(ctx, frontend.address, "w0", max_frame_bytes=1024)
    yield frontend, worker
    frontend.close()
    worker.close()
    ctx.term()


async def test_round_trip_both_directions_with_peer_id(pair):
    frontend, worker = pair
    await worker.sender.put(READY)
    received = await frontend.receiver.get()
    assert received.msg == READY and received.peer == b"w0" and received.raw_frames == []

    request = add_request("r1", deadline=123.5)
    await frontend.sender.put(request, peer=b"w0")
    assert (await worker.receiver.get()).msg == request


async def test_raw_frames_travel_next_to_the_header(pair):
    frontend, worker = pair
    payload = bytearray(range(256)) * 4096  # 1 MiB, sent without a copy
    header = Outputs("w0", [RequestDelta("r1", [1])])
    await worker.sender.put(header, raw_frames=[memoryview(payload), b"tail"])
    received = await frontend.receiver.get()
    assert received.msg == header
    assert [f.bytes for f in received.raw_frames] == [bytes(payload), b"tail"]


async def test_hostile_frames_are_rejected_and_counted_then_serving_continues(pair):
    frontend, worker = pair
    await worker.sender.put(READY)  # so the ROUTER knows the peer
    await frontend.receiver.get()
    for frames in HOSTILE_TO_WORKER.values():
        await frontend.socket.send_multipart([b"w0", *frames])
    await frontend.sender.put(AbortRequests(["ok"]), peer=b"w0")

    assert (await worker.receiver.get()).msg == AbortRequests(["ok"])
    assert worker.receiver.num_rejected == len(HOSTILE_TO_WORKER)
    assert worker.receiver.num_received == len(HOSTILE_TO_WORKER) + 1


async def test_frontend_rejects_a_worker_sending_nonsense(pair):
    frontend, worker = pair
    for frames in ([b"junk"], [PICKLED_DICT], [encode(add_request("x"))],
                   [encode(READY), b"1", b"2", b"3"]):
        await worker.socket.send_multipart(frames)
    heartbeat = Heartbeat("w0", WorkerStats(num_steps=3))
    await worker.sender.put(heartbeat)
    assert (await frontend.receiver.get()).msg == heartbeat
    assert frontend.receiver.num_rejected == 4


async def test_a_context_with_messages_for_a_missing_peer_terminates_at_once():
    """duplex.engine.zmq_io.new_context: sockets default to LINGER 0, so term (and the destroy a
    leaked context gets from the garbage collector, which once hung a CI worker) does not
    wait forever on a message queued for a peer that never came."""
    import threading
    import zmq

    from duplex.engine.zmq_io import new_context
    ctx = new_context()
    socket = ctx.socket(zmq.DEALER)
    socket.connect("tcp://127.0.0.1:9")  # nothing listens: the message stays queued
    socket.send(b"never delivered", zmq.NOBLOCK)
    socket.close()
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(5.0)
    assert not done.is_alive(), "term() waited on a queued message"


def test_a_context_collected_in_one_cycle_with_its_socket_does_not_block_the_collector():
    """A context and its socket dropped together in a reference cycle: pyzmq's finalizer
    finds no socket to close (their weak references are cleared first) and its `term` waited
    forever on the collecting thread (a full test run hung so, in an event loop); a context
    from new_context terms on a thread of its own, which ends when the socket is closed."""
    import gc
    import threading
    import zmq

    from duplex.engine.zmq_io import new_context
    was_enabled = gc.isenabled()
    gc.disable()  # the cycle is collected below, on the thread that watches
    try:
        ctx = new_context()
        holder = {"ctx": ctx, "socket": ctx.socket(zmq.DEALER)}
        holder["self"] = holder
        del ctx, holder
        collected = threading.Event()
        threading.Thread(target=lambda: (gc.collect(), collected.set()), daemon=True).start()
        assert collected.wait(10), "gc.collect() blocked in the context's finalizer"
    finally:
        if was_enabled:
            gc.enable()
    deadline = time.monotonic() + 10
    while any(t.name == "zmq-term" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the context never terminated"
        time.sleep(0.05)

"""CURVE on the worker channel and the KV door (engine.curve, engine.zmq_io): a peer without
the deployment key cannot connect at all, and a Ready claiming a live worker's id is refused
even from a peer that holds the key; the real worker keeps serving throughout."""
from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import zmq
import zmq.asyncio

from duplex.engine import curve
from duplex.engine.config import EngineConfig
from duplex.engine.messages import (Heartbeat, KvCancel, Outputs, Ready, RequestDelta, WorkerStats,
                             encode)
from duplex.engine.worker import Worker
from duplex.engine.zmq_io import kv_client_channel, kv_server_channel
from duplex.frontend.engine_client import EngineClient

from .conftest import HEARTBEAT_S, add_request, collect, tokens, until
from .fake_core import FakeCore, expected_tokens

QUIET_S = 1.0  # how long a rogue peer is given to get through


@pytest.fixture
def keys() -> curve.CurveKeys:
    return curve.generate()


@pytest.fixture
async def keyed_engine(keys):
    """An EngineClient on tcp with CURVE, and one real in-process worker (FakeCore) on it."""
    client = EngineClient("tcp://127.0.0.1:*", keys=keys, heartbeat_timeout_s=3.0)
    await client.start()
    worker = Worker(EngineConfig.of(heartbeat_s=HEARTBEAT_S), FakeCore, address=client.address,
                    worker_id="w0", keys=keys)
    task = asyncio.create_task(worker.run())
    await client.wait_ready(10)
    ctx = zmq.asyncio.Context()
    yield client, ctx
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await client.close()
    ctx.destroy(linger=0)


def rogue(ctx, address: str, routing_id: bytes, keys: curve.CurveKeys | None,
          server_key: bytes | None = None) -> zmq.asyncio.Socket:
    """A DEALER that knows the address (and maybe the server's public key or the secret)."""
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, routing_id)
    socket.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        socket.curve_secretkey, socket.curve_publickey = keys.secret, keys.public
        socket.curve_serverkey = server_key or keys.public
    socket.connect(address)
    return socket


def spoof_frames(pid: int) -> list[bytes]:
    return [encode(Ready("w0", "unified", "impostor", 256, 16, 64, pid=pid)),
            encode(Heartbeat("w0", WorkerStats(num_steps=999), pid=pid)),
            encode(Outputs("w0", [RequestDelta("r-any", [1], finish_reason="stop")]))]


async def assert_still_served_by_the_real_worker(client: EngineClient) -> None:
    assert client.workers()["w0"].pid == os.getpid()
    assert client.workers()["w0"].model_name == "fake"
    deltas = await asyncio.wait_for(collect(client, add_request("check", [40], 3)), 10)
    assert tokens(deltas) == expected_tokens([40], 3)


def offer(socket: zmq.asyncio.Socket, frame: bytes) -> None:
    """Queue `frame` if the socket will take it now. A DEALER whose handshake was refused
    may have no connection to queue on, and then a blocking send waits forever (this test
    once hung so): a frame it cannot even queue does not get through either."""
    sent = socket.send(frame, zmq.NOBLOCK)  # a future, done at once: sent, or zmq.Again
    error = sent.exception()
    if error is not None and not isinstance(error, zmq.Again):
        raise error


async def assert_nothing_reaches(socket: zmq.asyncio.Socket) -> None:
    assert await socket.poll(int(QUIET_S * 1000)) == 0


async def test_peers_without_the_key_cannot_connect(keyed_engine, keys):
    client, ctx = keyed_engine
    other = curve.generate()
    peers = [rogue(ctx, client.address, b"w0", None),  # plain, stolen routing id
             rogue(ctx, client.address, b"w0", other, keys.public),  # own key, knows server's
             rogue(ctx, client.address, b"r2", curve.derive(b"w" * 40))]  # a wrong secret
    for peer in peers:
        for frame in [*spoof_frames(pid=os.getpid()), b"junk"]:  # junk: a rejected frame
            offer(peer, frame)
    await asyncio.sleep(QUIET_S)
    await assert_still_served_by_the_real_worker(client)
    for peer in peers:
        await assert_nothing_reaches(peer)  # no request ever went to an impostor
    assert client.num_refused_ready == 0  # nothing of theirs reached our code at all
    assert client._channel.receiver.num_rejected == 0
    assert client.worker_stats()["w0"].num_steps != 999
    for peer in peers:
        peer.close()


async def test_ready_spoof_from_an_authenticated_peer_is_refused(keyed_engine, keys):
    client, ctx = keyed_engine
    spy = rogue(ctx, client.address, b"spy", keys)  # holds the key, another connection
    for pid in (os.getpid(), 4242):  # the live worker's own pid, and another process's
        await spy.send(spoof_frames(pid)[0])
    await until(lambda: client.num_refused_ready == 2, timeout_s=5)
    await spy.send(spoof_frames(4242)[2])  # Outputs from an unknown connection: dropped
    twin = rogue(ctx, client.address, b"w0", keys)  # the live id itself: no handover
    for frame in spoof_frames(pid=os.getpid()):
        await twin.send(frame)
    await assert_still_served_by_the_real_worker(client)
    await assert_nothing_reaches(spy)
    await assert_nothing_reaches(twin)
    assert set(client.workers()) == {"w0"}
    spy.close()
    twin.close()


async def test_kv_door_admits_only_key_holders(keys):
    ctx = zmq.asyncio.Context()
    door = kv_server_channel(ctx, "tcp://127.0.0.1:*", max_raw_frames=4, keys=keys)
    good = kv_client_channel(ctx, door.address, "p0", keys)
    plain = kv_client_channel(ctx, door.address, "p1")
    try:
        with contextlib.suppress(TimeoutError):  # refused: maybe nothing to queue on
            await asyncio.wait_for(plain.sender.put(KvCancel("from-rogue")), QUIET_S)
        await good.sender.put(KvCancel("from-prefill"))
        received = await asyncio.wait_for(door.receiver.get(), 5)
        assert (received.msg.req_id, received.peer) == ("from-prefill", b"p0")
        assert await door.socket.poll(int(QUIET_S * 1000)) == 0
    finally:
        for channel in (good, plain, door):
            channel.close()
        ctx.term()


def test_key_files_and_shared_secrets(tmp_path):
    keys = curve.generate()
    path = tmp_path / "duplex.key"
    curve.write_key_file(path, keys)
    assert curve.load(path) == keys
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        curve.write_key_file(path, keys)  # never overwrites a key
    secret = tmp_path / "secret"
    secret.write_bytes(b"<" + os.urandom(32) + b">")  # ends that strip() keeps: 34 bytes
    derived = curve.load(secret)
    assert derived == curve.load(secret) and derived != keys
    assert zmq.curve_public(derived.secret) == derived.public
    (tmp_path / "short").write_bytes(b"password")
    with pytest.raises(ValueError, match="at least 32 bytes"):
        curve.load(tmp_path / "short")


def test_addresses_off_this_host_need_a_key(tmp_path):
    assert curve.load_keys(None, "ipc:///tmp/x.ipc", "tcp://127.0.0.1:5555", None) is None
    for address in ("tcp://0.0.0.0:5555", "tcp://10.0.0.5:5555", "tcp://*:5555"):
        assert not curve.is_local(address)
        with pytest.raises(ValueError, match="--worker-key"):
            curve.load_keys(None, address)
    path = tmp_path / "k"
    curve.write_key_file(path, curve.generate())
    assert curve.load_keys(str(path), "tcp://0.0.0.0:5555") == curve.load(path)

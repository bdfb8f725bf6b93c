"""duplex.frontend.engine_client with hand-held workers (bare DEALER sockets): the split route, the
hand-off failure policy (recompute from the tokens seen, or fail), ordering of tokens from the
decode worker that overtake the first token, and aborts reaching every worker involved."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from duplex.engine.messages import (AbortRequests, AddRequest, HandoffFailed, Heartbeat, Outputs,
                             Ready, RequestDelta, WorkerStats, decode_to_worker, encode)
from duplex.engine.sampling_params import SamplingParams
from duplex.frontend.engine_client import HANDOFF_PREFIX, EngineClient
from duplex.frontend.router import Router

KV_ADDRESS = "tcp://127.0.0.1:5999"


class HandWorker:
    """A DEALER posing as a worker: announces itself, reads what the client sends."""

    def __init__(self, ctx, address: str, worker_id: str, role: str) -> None:
        self.worker_id = worker_id
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.ROUTING_ID, worker_id.encode())
        self.socket.connect(address)
        self.ready = Ready(worker_id, role, "m", 256, 16, 64, pid=hash(worker_id) % 10**6,
                           kv_address=KV_ADDRESS if role == "decode" else "")

    async def announce(self) -> None:
        await self.send(self.ready)
        await self.send(Heartbeat(self.worker_id, WorkerStats()))

    async def send(self, msg) -> None:
        await self.socket.send(encode(msg))

    async def deltas(self, req_id: str, token_ids: list[int], finish: str | None = None):
        await self.send(Outputs(self.worker_id, [RequestDelta(
            req_id, token_ids, finish_reason=finish, num_prompt_tokens=3,
            num_cached_tokens=16 if self.ready.role == "prefill" else 48)]))

    async def receive(self, timeout_s: float = 5.0):
        return decode_to_worker(await asyncio.wait_for(self.socket.recv(), timeout_s))


@pytest.fixture
async def split(tmp_path):
    async def start(policy: str = "recompute"):
        client = EngineClient(f"ipc://{tmp_path}/c.ipc", router=Router(), handoff_failure=policy)
        await client.start()
        prefill = HandWorker(ctx, client.address, "p0", "prefill")
        decode = HandWorker(ctx, client.address, "d0", "decode")
        for worker in (prefill, decode):
            await worker.announce()
        async with asyncio.timeout(5):
            while len(client.workers()) < 2:
                await asyncio.sleep(0.01)
        clients.append(client)
        return client, prefill, decode

    ctx = zmq.asyncio.Context()
    clients: list[EngineClient] = []
    yield start
    for client in clients:
        await client.close()
    ctx.destroy(linger=0)


def add(req_id: str) -> AddRequest:
    return AddRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=8))


async def test_route_names_the_decode_worker_and_tokens_come_in_order(split):
    client, prefill, decode = await split()
    stream = client.generate(add("r"))
    first_delta = asyncio.ensure_future(anext(stream))
    sent = await prefill.receive()
    assert (sent.handoff_to, sent.handoff_address) == ("d0", KV_ADDRESS)
    await decode.deltas("r", [11])  # overtakes the prefill worker's first token: held back
    await prefill.deltas("r", [10])
    await decode.deltas("r", [12], finish="length")
    deltas = [await first_delta] + [d async for d in stream]
    assert [t for d in deltas for t in d.new_token_ids] == [10, 11, 12]
    assert {d.num_cached_tokens for d in deltas} == {16}  # the prefill worker's hit


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_failed_handoff_recomputes_or_fails(split, policy):
    client, prefill, decode = await split(policy)
    stream = client.generate(add("r"))
    first_delta = asyncio.ensure_future(anext(stream))
    await prefill.receive()
    await prefill.deltas("r", [10])
    assert (await first_delta).new_token_ids == [10]
    await prefill.send(HandoffFailed("p0", "r", "d0", "no acknowledgement within the lease"))
    if policy == "fail":
        [final] = [d async for d in stream]
        assert (final.finish_reason, final.error) == (
            "error", HANDOFF_PREFIX + "no acknowledgement within the lease")
        return
    resumed = await decode.receive()
    assert (resumed.req_id, resumed.output_token_ids, resumed.handoff_to) == ("r", [10], "")
    await decode.deltas("r", [11], finish="length")
    assert [d.new_token_ids async for d in stream] == [[11]]


async def test_decode_worker_death_before_the_first_token_moves_the_stream(split):
    client, prefill, decode = await split()
    stream = client.generate(add("r"))
    first_delta = asyncio.ensure_future(anext(stream))
    await prefill.receive()
    client.worker_exited(decode.ready.pid, "killed by SIGKILL")
    await prefill.deltas("r", [10])
    assert (await first_delta).new_token_ids == [10]
    # no decode worker left: the prefill worker continues the request itself, from the
    # token the client has seen (re-adding it there supersedes its hand-off)
    resumed = await prefill.receive()
    assert resumed.output_token_ids == [10] and not resumed.handoff_to
    await prefill.deltas("r", [11], finish="length")
    assert [d.new_token_ids async for d in stream] == [[11]]


async def test_abandoned_stream_is_aborted_on_both_workers(split):
    client, prefill, decode = await split()
    stream = client.generate(add("r"))
    first_delta = asyncio.ensure_future(anext(stream))
    await prefill.receive()
    await prefill.deltas("r", [10])
    await first_delta
    await stream.aclose()
    aborts = [await prefill.receive(), await decode.receive()]
    assert all(msg == AbortRequests(["r"]) for msg in aborts)
    assert client.num_in_flight == 0


async def test_explicit_abort_ends_the_stream_at_once(split):
    client, prefill, _ = await split()
    stream = client.generate(add("r"))
    first_delta = asyncio.ensure_future(anext(stream))
    await prefill.receive()
    await client.abort("r")
    assert (await first_delta).finish_reason == "abort"
    assert msgspec.structs.asdict(await prefill.receive()) == {"req_ids": ["r"]}

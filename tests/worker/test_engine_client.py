"""duplex.frontend.engine_client against a real worker process (fake core) under a Supervisor:
streams, aborts, deadlines, and exactly one terminal delta per stream when the worker dies."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq
import zmq.asyncio

from duplex.engine.messages import Heartbeat, Ready, WorkerStats, encode
from duplex.frontend.engine_client import DEAD_PREFIX, EngineClient

from .conftest import add_request, collect, is_running, tokens, until
from .fake_core import CRASH_TOKEN, expected_tokens
from .test_zmq_io import PICKLED_DICT


def fake_core_counter(client: EngineClient, name: str) -> int:
    """A FakeCore counter from the latest heartbeat (0 before the first)."""
    stats = client.stats()
    return getattr(stats, name) if stats else 0


def num_aborted(client: EngineClient) -> int:
    return fake_core_counter(client, "num_requests_aborted")


def finals(deltas):
    return [(d.finish_reason, d.error) for d in deltas if d.finish_reason is not None]


async def test_requests_stream_in_order_and_many_run_concurrently(start_engine):
    engine = await start_engine(step_sleep_s=0.002)
    prompts = {f"r{i}": [i + 1] for i in range(40)}
    results = await asyncio.gather(*(collect(engine.client, add_request(req_id, prompt, 8))
                                     for req_id, prompt in prompts.items()))
    for (req_id, prompt), deltas in zip(prompts.items(), results):
        assert tokens(deltas) == expected_tokens(prompt, 8)
        assert finals(deltas) == [("length", "")]
        assert all(d.req_id == req_id for d in deltas)
    assert engine.client.num_in_flight == 0
    await until(lambda: fake_core_counter(engine.client, "num_requests_added") == 41)  # + warm-up


async def test_invalid_request_ends_with_one_error_delta(start_engine):
    engine = await start_engine()
    deltas = await collect(engine.client, add_request("bad", [-5]))
    assert finals(deltas) == [("error", "token ids must be in [0, 1000000)")]


async def test_consumer_that_stops_iterating_aborts_the_request(start_engine):
    engine = await start_engine(step_sleep_s=0.01)

    async def read_two_then_leave() -> None:
        num_read = 0
        async for _ in engine.client.generate(add_request("left", max_tokens=200)):
            num_read += 1
            if num_read == 2:
                break

    await read_two_then_leave()
    await until(lambda: num_aborted(engine.client) == 1)
    assert engine.client.num_in_flight == 0


async def test_cancelled_consumer_aborts_the_request(start_engine):
    engine = await start_engine(step_sleep_s=0.01)
    first_delta = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.client.generate(add_request("cancelled", max_tokens=200)):
            first_delta.set()

    task = asyncio.create_task(consume())
    await first_delta.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until(lambda: num_aborted(engine.client) == 1)


async def test_explicit_abort_ends_the_stream_with_an_abort_delta(start_engine):
    engine = await start_engine(step_sleep_s=0.01)
    stream = engine.client.generate(add_request("x", max_tokens=200))
    first = await anext(stream)
    await engine.client.abort("x")
    rest = [delta async for delta in stream]
    assert first.finish_reason is None and finals(rest) == [("abort", "")]
    await until(lambda: num_aborted(engine.client) == 1)


async def test_deadline_ends_the_stream(start_engine):
    engine = await start_engine(step_sleep_s=0.01)
    start = time.time()
    deltas = await collect(engine.client, add_request("t", max_tokens=200, deadline=start + 0.3))
    assert finals(deltas) == [("abort", "deadline exceeded")]
    assert time.time() - start < 2.0


async def test_duplicate_request_id_is_refused(start_engine):
    engine = await start_engine(step_sleep_s=0.01)
    stream = engine.client.generate(add_request("same", max_tokens=50))
    await anext(stream)
    with pytest.raises(ValueError, match="already in flight"):
        await anext(engine.client.generate(add_request("same")))
    await stream.aclose()


async def run_until_worker_death(engine, kill, num_requests: int = 5):
    """Start long requests, kill the worker once each has a delta, return every stream."""
    started = [asyncio.Event() for _ in range(num_requests)]

    async def consume(i: int):
        deltas = []
        async for delta in engine.client.generate(add_request(f"r{i}", max_tokens=200)):
            deltas.append(delta)
            started[i].set()
        return deltas

    tasks = [asyncio.create_task(consume(i)) for i in range(num_requests)]
    await asyncio.gather(*(event.wait() for event in started))
    kill()
    return await asyncio.wait_for(asyncio.gather(*tasks), 10)


async def assert_restarts_and_serves(engine, old_pid: int) -> None:
    await engine.client.wait_ready(30)
    assert engine.pid != old_pid and not is_running(old_pid)
    assert engine.supervisor.status()[0].num_restarts == 1
    assert tokens(await collect(engine.client, add_request("after", [1], 3))) == [2, 3, 4]


async def test_sigkilled_worker_fails_each_stream_once_then_is_restarted(start_engine):
    engine = await start_engine(step_sleep_s=0.01)
    old_pid = engine.pid
    streams = await run_until_worker_death(engine, lambda: os.kill(old_pid, signal.SIGKILL))

    for deltas in streams:
        assert finals(deltas) == [("error", DEAD_PREFIX + "killed by SIGKILL")]
        assert deltas[-1].finish_reason == "error"
    assert not engine.client.ready and engine.client.num_in_flight == 0
    refused = await collect(engine.client, add_request("too-early"))
    assert finals(refused) == [("error", "engine worker not ready")]
    await assert_restarts_and_serves(engine, old_pid)


async def test_worker_error_fails_each_stream_once_then_is_restarted(start_engine):
    engine = await start_engine(step_sleep_s=0.01)
    old_pid = engine.pid

    def crash() -> None:
        asyncio.ensure_future(collect(engine.client, add_request("boom", [CRASH_TOKEN])))

    streams = await run_until_worker_death(engine, crash)
    for deltas in streams:
        assert finals(deltas) == [("error", DEAD_PREFIX + "RuntimeError: fake core crash")]
    await assert_restarts_and_serves(engine, old_pid)


async def test_silent_worker_is_declared_dead_and_replaced(start_engine):
    engine = await start_engine(step_sleep_s=0.01, heartbeat_timeout_s=0.6)
    old_pid = engine.pid
    try:
        streams = await run_until_worker_death(engine, lambda: os.kill(old_pid, signal.SIGSTOP))
    finally:
        if is_running(old_pid):
            os.kill(old_pid, signal.SIGKILL)
    for deltas in streams:
        [(reason, error)] = finals(deltas)
        assert reason == "error" and error.startswith(DEAD_PREFIX + "no heartbeat for")
    await assert_restarts_and_serves(engine, old_pid)


async def test_close_ends_in_flight_streams_once(start_engine):
    engine = await start_engine(step_sleep_s=0.01)
    streams = await run_until_worker_death(engine, lambda: asyncio.ensure_future(
        engine.client.close()), num_requests=3)
    for deltas in streams:
        assert finals(deltas) == [("error", "engine client closed")]


async def test_client_ignores_hostile_frames_from_a_worker(tmp_path):
    client = EngineClient(f"ipc://{tmp_path}/c.ipc")
    await client.start()
    ctx = zmq.asyncio.Context()
    fake_worker = ctx.socket(zmq.DEALER)
    fake_worker.setsockopt(zmq.ROUTING_ID, b"w0")
    fake_worker.connect(client.address)
    try:
        for frames in ([b"junk"], [PICKLED_DICT], [encode(add_request("x"))], [b""]):
            await fake_worker.send_multipart(frames)
        await fake_worker.send(encode(Ready("w0", "unified", "fake", 256, 16, 64, pid=1)))
        await fake_worker.send(encode(Heartbeat("w0", WorkerStats(num_steps=7))))
        assert (await client.wait_ready(5)).pid == 1
        await until(lambda: client.stats() is not None)
        assert client.stats().num_steps == 7
        assert client._channel.receiver.num_rejected == 4
    finally:
        fake_worker.close(linger=0)
        ctx.term()
        await client.close()

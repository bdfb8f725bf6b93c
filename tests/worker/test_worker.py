"""duplex.engine.worker: the worker loop driven over its real ZMQ channel by a hand-held frontend.

Most tests run the Worker in-process on a FakeCore (fast, inspectable); the hostile-frame test
runs `python -m duplex.engine.worker_cli` as a real subprocess."""
from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from duplex.engine.config import EngineConfig
from duplex.engine.messages import (MAX_FRAME_BYTES, AbortRequests, Heartbeat, Outputs, Ready,
                             Shutdown, WorkerError)
from duplex.engine.worker import DEADLINE_ERROR, SHUTDOWN_ERROR, Worker

from .conftest import (HEARTBEAT_S, RawFrontend, add_request, subprocess_env, tokens,
                       worker_command)
from .fake_core import CRASH_TOKEN, FakeCore, expected_tokens
from .test_zmq_io import HOSTILE_TO_WORKER, PICKLED_DICT


class Harness:
    """One in-process worker on a FakeCore; `core` is the very object the worker drives."""

    def __init__(self, frontend, *, core_factory=None, step_in_thread=True, **knobs) -> None:
        self.core: FakeCore | None = None
        self.frontend = frontend

        def build(config: EngineConfig):
            self.core = (core_factory or FakeCore)(config, **knobs)
            return self.core

        self.worker = Worker(EngineConfig.of(heartbeat_s=HEARTBEAT_S), build,
                             address=frontend.address, worker_id="w0",
                             step_in_thread=step_in_thread)
        self.task = asyncio.create_task(self.worker.run())

    async def ready(self) -> Ready:
        return await self.frontend.next(Ready)

    async def exit_code(self, timeout_s: float = 10.0) -> int:
        return await asyncio.wait_for(self.task, timeout_s)


@pytest.fixture
async def start_worker(raw_frontend):
    harnesses: list[Harness] = []

    async def start(**kwargs) -> Harness:
        harness = Harness(raw_frontend, **kwargs)
        harnesses.append(harness)
        await harness.ready()
        return harness

    yield start
    for harness in harnesses:
        harness.task.cancel()
        await asyncio.gather(harness.task, return_exceptions=True)


def by_request(deltas):
    grouped = {}
    for delta in deltas:
        grouped.setdefault(delta.req_id, []).append(delta)
    return grouped


async def test_handshake_ready_after_warm_up_then_heartbeats(raw_frontend):
    harness = Harness(raw_frontend)
    ready = await harness.ready()
    assert ready == Ready("w0", "unified", "fake", 256, 16, 64, pid=os.getpid())
    assert harness.core.num_steps == 1 and not harness.core.requests  # warm-up ran, is gone
    heartbeat = await raw_frontend.next(Heartbeat, skip_heartbeats=False)
    assert heartbeat.worker_id == "w0" and heartbeat.stats.num_rejected_frames == 0
    harness.task.cancel()


async def test_requests_stream_their_deltas_in_order(start_worker, raw_frontend):
    await start_worker()
    for req_id, prompt in (("a", [5]), ("b", [100, 200])):
        await raw_frontend.send(add_request(req_id, prompt, max_tokens=6))
    grouped = by_request(await raw_frontend.deltas_until_finished({"a", "b"}))

    assert tokens(grouped["a"]) == expected_tokens([5], 6)
    assert tokens(grouped["b"]) == expected_tokens([100, 200], 6)
    for deltas in grouped.values():
        assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
        assert deltas[0].num_prompt_tokens > 0


async def test_invalid_request_gets_an_immediate_error_delta(start_worker, raw_frontend):
    harness = await start_worker()
    await raw_frontend.send(add_request("empty", [], max_tokens=2))
    await raw_frontend.send(add_request("long", [1] * 300, max_tokens=2))
    await raw_frontend.send(add_request("good", [1], max_tokens=2))
    grouped = by_request(await raw_frontend.deltas_until_finished({"empty", "long", "good"}))

    assert [(d.finish_reason, d.error) for d in grouped["empty"]] == [("error", "prompt is empty")]
    assert grouped["long"][0].finish_reason == "error"
    assert "exceeds max_model_len 256" in grouped["long"][0].error
    assert tokens(grouped["good"]) == [2, 3]
    assert harness.core.num_added == 2  # warm-up + good


async def test_abort_frees_the_request_and_ends_it_once(start_worker, raw_frontend):
    harness = await start_worker(step_sleep_s=0.01)
    await raw_frontend.send(add_request("long", max_tokens=200))
    await raw_frontend.next(Outputs)
    await raw_frontend.send(AbortRequests(["long", "never-existed"]))
    deltas = await raw_frontend.deltas_until_finished({"long"})

    assert [(d.finish_reason, d.error) for d in deltas if d.finish_reason] == [("abort", "")]
    assert harness.core.aborted_req_ids == ["long"]
    assert not harness.core.requests


async def test_deadline_is_enforced(start_worker, raw_frontend):
    harness = await start_worker(step_sleep_s=0.02)
    start = time.time()
    await raw_frontend.send(add_request("late", max_tokens=200, deadline=start + 0.3))
    await raw_frontend.send(add_request("dead-on-arrival", deadline=start - 1))
    deltas = await raw_frontend.deltas_until_finished({"late", "dead-on-arrival"})
    elapsed = time.time() - start

    finals = {d.req_id: (d.finish_reason, d.error) for d in deltas if d.finish_reason}
    assert finals == {"late": ("abort", DEADLINE_ERROR),
                      "dead-on-arrival": ("error", DEADLINE_ERROR)}
    assert 0.3 <= elapsed < 2.0
    assert harness.core.aborted_req_ids == ["late"]


async def test_shutdown_drains_running_requests_and_refuses_new_ones(start_worker, raw_frontend):
    harness = await start_worker(step_sleep_s=0.01)
    await raw_frontend.send(add_request("a", max_tokens=10))
    await raw_frontend.send(Shutdown(drain_timeout_s=10.0))
    await raw_frontend.send(add_request("b"))
    grouped = by_request(await raw_frontend.deltas_until_finished({"a", "b"}))

    assert grouped["a"][-1].finish_reason == "length" and len(tokens(grouped["a"])) == 10
    assert [(d.finish_reason, d.error) for d in grouped["b"]] == [("error", SHUTDOWN_ERROR)]
    assert await harness.exit_code() == 0


async def test_shutdown_without_drain_aborts_what_runs(start_worker, raw_frontend):
    harness = await start_worker(step_sleep_s=0.01)
    await raw_frontend.send(add_request("a", max_tokens=200))
    await raw_frontend.next(Outputs)
    await raw_frontend.send(Shutdown())
    deltas = await raw_frontend.deltas_until_finished({"a"})
    assert (deltas[-1].finish_reason, deltas[-1].error) == ("abort", SHUTDOWN_ERROR)
    assert await harness.exit_code() == 0


async def test_core_exception_sends_worker_error_and_exits_nonzero(start_worker, raw_frontend):
    harness = await start_worker()
    await raw_frontend.send(add_request("boom", [CRASH_TOKEN]))
    error = await raw_frontend.next(WorkerError)
    assert error == WorkerError("w0", "RuntimeError: fake core crash")
    assert await harness.exit_code() == 1


async def test_model_load_failure_sends_worker_error(raw_frontend):
    def broken(config):
        raise FileNotFoundError("no such model")

    harness = Harness(raw_frontend, core_factory=broken)
    assert await raw_frontend.next(WorkerError) == WorkerError(
        "w0", "FileNotFoundError: no such model")
    assert await harness.exit_code() == 1


@pytest.mark.parametrize("step_in_thread", [True, False])
async def test_heartbeats_keep_coming_while_a_long_step_runs(start_worker, raw_frontend,
                                                             step_in_thread):
    """The reason the step runs in a thread: the loop keeps serving while the core computes.
    Inline stepping is the control: there, each 0.6 s step silences the worker for 0.6 s.
    Gaps are measured on the worker's own send times (Heartbeat.time)."""
    step_s = 0.6
    await start_worker(step_sleep_s=step_s, step_in_thread=step_in_thread)
    sent_at = [time.time()]
    await raw_frontend.send(add_request("slow", max_tokens=2))
    finished = False
    while not finished:
        msg = await raw_frontend.next((Heartbeat, Outputs), skip_heartbeats=False)
        if isinstance(msg, Heartbeat):
            sent_at.append(msg.time)
        else:
            finished = any(d.finish_reason for d in msg.deltas)
    sent_at.append((await raw_frontend.next(Heartbeat, skip_heartbeats=False)).time)
    max_gap = max(b - a for a, b in zip(sent_at, sent_at[1:]))
    if step_in_thread:
        assert len(sent_at) >= 2 * step_s / HEARTBEAT_S / 2 and max_gap < step_s / 2
    else:
        assert max_gap >= step_s * 0.9


@pytest.fixture
async def worker_process(raw_frontend):
    process = subprocess.Popen(worker_command(raw_frontend.address, "--role", "decode"),
                               env=subprocess_env(), stderr=subprocess.PIPE)
    yield process
    process.kill()
    process.wait()


async def test_worker_process_survives_hostile_frames_and_idles_without_spinning(
        raw_frontend, worker_process):
    """Garbage, pickle, an oversized frame, an unknown tag, wrong field types, a msgpack map
    posing as an object: each is logged and counted by the worker process, which serves on."""
    ready = await raw_frontend.next(Ready, timeout_s=30)
    assert (ready.role, ready.pid) == ("decode", worker_process.pid)
    hostile = [*HOSTILE_TO_WORKER.values(), [b"\x91" + b"\x00" * MAX_FRAME_BYTES],
               [msgspec.msgpack.encode({"__class__": "os.system", "args": ["true"]})],
               [PICKLED_DICT, PICKLED_DICT]]
    for frames in hostile:
        await raw_frontend.send_raw(*frames)
    await raw_frontend.send(add_request("after", [7], max_tokens=3))
    deltas = await raw_frontend.deltas_until_finished({"after"})
    assert tokens(deltas) == [8, 9, 10]

    cpu_before = _cpu_seconds(worker_process.pid)
    await asyncio.sleep(1.0)  # idle: the worker must wait, not spin
    heartbeat = await raw_frontend.next(Heartbeat, skip_heartbeats=False)
    assert _cpu_seconds(worker_process.pid) - cpu_before < 0.25
    assert heartbeat.stats.num_rejected_frames == len(hostile)
    assert worker_process.poll() is None
    worker_process.terminate()
    _, log = worker_process.communicate(timeout=10)
    assert worker_process.returncode == 0  # SIGTERM: a clean shutdown
    assert log.count(b"rejected frame #") == len(hostile)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def test_worker_announces_itself_again_to_a_restarted_frontend(tmp_path):
    """A frontend that restarts (a worker on another host outlives it) gets a fresh Ready."""
    address = f"ipc://{tmp_path}/restart.ipc"
    first = RawFrontend(address)
    harness = Harness(first)
    assert (await first.next(Ready)).pid == os.getpid()
    first.close()

    second = RawFrontend(address)
    try:
        assert (await second.next(Ready)).pid == os.getpid()
        await second.send(add_request("again", [1], max_tokens=2))
        assert tokens(await second.deltas_until_finished({"again"})) == [2, 3]
    finally:
        harness.task.cancel()
        await asyncio.gather(harness.task, return_exceptions=True)
        second.close()


@pytest.mark.parametrize("flags, reason", [
    (["--heartbeat-s", "0"], "heartbeat_s must be > 0"),
    (["--kv-bind", "10.0.0.6:5600"], "kv_bind must be tcp://HOST:PORT"),
    (["--role", "decode", "--expert-parallel", "2"], "role must be unified with expert_parallel"),
])
def test_a_worker_flag_its_section_refuses_exits_2_with_the_reason(flags, reason):
    result = subprocess.run(worker_command("ipc:///nonexistent/frontend.ipc") + flags,
                            env=subprocess_env(), stderr=subprocess.PIPE, text=True, timeout=60)
    assert result.returncode == 2
    assert reason in result.stderr and "Traceback" not in result.stderr

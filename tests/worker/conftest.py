"""Factories for worker tests: a supervised fake worker with its client, a bare frontend socket
for talking to a worker directly, and small helpers to drain streams."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import msgspec
import pytest

from duplex.engine.config import EngineConfig
from duplex.engine.messages import AddRequest, Heartbeat, Outputs, Ready, RequestDelta
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.zmq_io import Channel, frontend_channel, new_context
from duplex.frontend.engine_client import EngineClient
from duplex.frontend.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]
FAKE_CORE = "tests.worker.fake_core:FakeCore"
HEARTBEAT_S = 0.1


def fake_worker_env(**knobs: float) -> dict[str, str]:
    return {"DUPLEX_FAKE_CORE": json.dumps(knobs), "PYTHONPATH": str(REPO)}


def add_request(req_id: str, prompt: list[int] | None = None, max_tokens: int = 4,
                **fields) -> AddRequest:
    prompt = [10, 20, 30] if prompt is None else prompt
    return AddRequest(req_id, prompt, SamplingParams(max_tokens=max_tokens),
                      **fields)


async def collect(client: EngineClient, msg: AddRequest) -> list[RequestDelta]:
    return [delta async for delta in client.generate(msg)]


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for delta in deltas for t in delta.new_token_ids]


async def until(predicate, timeout_s: float = 10.0, interval_s: float = 0.02) -> None:
    """Wait until predicate() is true; fail the test after timeout_s."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(interval_s)


def is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (checked in /proc, no psutil needed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Engine:
    """A supervisor running one fake worker subprocess, and the client talking to it."""

    def __init__(self, supervisor: Supervisor, client: EngineClient) -> None:
        self.supervisor, self.client = supervisor, client

    @property
    def pid(self) -> int:
        return self.client.ready_info.pid


@pytest.fixture
async def start_engine():
    engines: list[Engine] = []

    async def start(*, heartbeat_timeout_s: float = 3.0, config: EngineConfig | None = None,
                    **knobs: float) -> Engine:
        supervisor = Supervisor(config or EngineConfig(), restart_backoff_s=(0.05, 0.5),
                                worker_args=["--core", FAKE_CORE, "--heartbeat-s",
                                             str(HEARTBEAT_S)],
                                env=fake_worker_env(**knobs))
        client = EngineClient(supervisor.addresses[0], heartbeat_timeout_s=heartbeat_timeout_s)
        supervisor.attach(client)
        engine = Engine(supervisor, client)
        engines.append(engine)
        await client.start()
        await supervisor.start()
        await client.wait_ready(30)
        return engine

    yield start
    for engine in engines:
        await engine.supervisor.close(grace_s=2.0)
        await engine.client.close()


class RawFrontend:
    """The frontend end of a worker channel, driven by hand: send any bytes, read messages."""

    def __init__(self, address: str) -> None:
        self.ctx = new_context()
        self.channel: Channel = frontend_channel(self.ctx, address)
        self.address = self.channel.address
        self.peer = b""

    async def send(self, msg: msgspec.Struct) -> None:
        await self.channel.sender.put(msg, peer=self.peer)

    async def send_raw(self, *frames: bytes) -> None:
        await self.channel.socket.send_multipart([self.peer, *frames])

    async def next(self, kind: type, timeout_s: float = 10.0, skip_heartbeats: bool = True):
        """The next message of type `kind` (heartbeats are skipped unless asked for, and so
        are the Ready messages a worker repeats every few heartbeats unless `kind` is Ready)."""
        async with asyncio.timeout(timeout_s):
            while True:
                msg, _, peer = await self.channel.receiver.get()
                self.peer = peer
                if isinstance(msg, kind):
                    return msg
                if isinstance(msg, Ready):
                    continue
                if not (skip_heartbeats and isinstance(msg, Heartbeat)):
                    raise AssertionError(f"expected {kind.__name__}, got {msg!r}")

    async def deltas_until_finished(self, req_ids: set[str], timeout_s: float = 10.0):
        """All deltas of req_ids, in arrival order, until each has had a final one."""
        pending, received = set(req_ids), []
        while pending:
            outputs = await self.next(Outputs, timeout_s)
            received += outputs.deltas
            pending -= {d.req_id for d in outputs.deltas if d.finish_reason is not None}
        return received

    def close(self) -> None:
        self.channel.close()
        self.ctx.term()


@pytest.fixture
def raw_frontend(tmp_path):
    frontend = RawFrontend(f"ipc://{tmp_path}/worker.ipc")
    yield frontend
    frontend.close()


def worker_command(address: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "duplex.engine.worker_cli", "--connect", address,
            "--worker-id", "w0", "--core", FAKE_CORE, "--heartbeat-s", str(HEARTBEAT_S), *extra]


def subprocess_env(**knobs: float) -> dict[str, str]:
    return {**os.environ, **fake_worker_env(**knobs)}

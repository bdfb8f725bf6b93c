"""A prefill worker process against a decode worker that takes the blocks but never answers
KvDone: the blocks arrive intact (same bytes as the engine computes, keyed as offered), the
lease ends, the blocks are freed and the frontend hears HandoffFailed; nothing hangs."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec
import pytest
import zmq
import zmq.asyncio

from duplex.engine.messages import (HandoffFailed, Heartbeat, KvBlocks, KvDone, KvNeed, KvOffer,
                             Outputs, Ready, decode_to_decode_kv, encode)
from tests.worker.conftest import RawFrontend

from .conftest import REPO, engine_config, request

LEASE_S = 1.0
PROMPT = [(13 * i + 2) % 300 for i in range(100)]  # 6 full blocks, two prefill chunks


@pytest.fixture
def frontend(tmp_path):
    frontend = RawFrontend(f"ipc://{tmp_path}/f.ipc")
    yield frontend
    frontend.close()


@pytest.fixture
def prefill_worker(frontend):
    config = msgspec.json.encode(engine_config()).decode()
    process = subprocess.Popen(
        [sys.executable, "-m", "duplex.engine.worker_cli", "--role", "prefill", "--connect",
         frontend.address, "--worker-id", "p0", "--heartbeat-s", "0.1", "--config-json", config,
         "--handoff-lease-s", str(LEASE_S)], cwd=REPO, stderr=subprocess.DEVNULL)
    yield process
    process.kill()
    process.wait()


def engine_blocks(keys: list[bytes]) -> list[bytes]:
    """The bytes of each prompt block as an in-process engine computes them."""
    from duplex.engine.core import EngineCore

    core = EngineCore(engine_config(), progress=False)
    core.add_request(request("ref", PROMPT, msgspec.structs.replace(
        request("x", [1]).params, max_tokens=1)))
    while core.has_unfinished_requests():
        core.step()
    return [core.runner.kv[:, :, core.pool.lookup(key)].contiguous().numpy().tobytes()
            for key in keys]


async def test_unacknowledged_handoff_ends_with_the_lease(frontend, prefill_worker):
    ctx = zmq.asyncio.Context()
    door = ctx.socket(zmq.ROUTER)
    door.bind("tcp://127.0.0.1:*")
    address = door.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        await frontend.next(Ready, timeout_s=60)
        await frontend.send(msgspec.structs.replace(
            request("r", PROMPT), handoff_to="d0", handoff_address=address))
        peer, offer = await _next_kv(door)
        assert isinstance(offer, KvOffer) and offer.request.prompt_token_ids == PROMPT
        assert len(offer.keys) == len(PROMPT) // 16 and not offer.request.handoff_to
        await door.send_multipart([peer, encode(KvNeed("r", list(range(1, 6))))])
        blocks: dict[bytes, bytes] = {}
        while True:
            _, msg, frames = await _next_kv(door, with_frames=True)
            if isinstance(msg, KvDone):
                break
            assert isinstance(msg, KvBlocks) and len(frames) == len(msg.keys)
            blocks.update(zip(msg.keys, (bytes(f) for f in frames)))
        assert sorted(blocks) == sorted(offer.keys[1:])  # only what was asked for
        first = await frontend.next(Outputs)
        assert first.deltas[0].finish_reason is None and msg.first_token_ids == \
            first.deltas[0].new_token_ids
        failed = await frontend.next(HandoffFailed, timeout_s=LEASE_S + 10)
        assert (failed.req_id, failed.decode_worker_id) == ("r", "d0")
        assert "lease" in failed.reason
        handoff = (await frontend.next(Heartbeat, skip_heartbeats=False)).stats.handoff
        assert handoff.blocks_pinned == 0  # freed before the report was sent
        assert handoff.failed == 1 and handoff.blocks_sent == 5
        cancel = (await _next_kv(door))[1]
        assert cancel.req_id == "r"  # the decode side is told to drop it
    finally:
        door.close(linger=0)
        ctx.term()
    assert [blocks[key] for key in offer.keys[1:]] == engine_blocks(offer.keys)[1:]


async def _next_kv(door, with_frames: bool = False):
    async with asyncio.timeout(30):
        peer, header, *frames = await door.recv_multipart()
    msg = decode_to_decode_kv(header)
    return (peer, msg, frames) if with_frames else (peer, msg)


"""The prefill/decode split end to end: a frontend client, one prefill and one decode worker
process (tiny Llama) on loopback. Output equals the unified engine's; only missing blocks
travel; hostile KV frames are rejected; killing either worker mid-stream leaves every stream
with its unified tokens (recomputed from what the client saw) and the supervisor restarts it.
The tests share one cluster and run in file order (the kills come last)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from duplex.engine.messages import KvBlocks, KvDone, KvOffer, encode

from .conftest import (GREEDY, REPO, VOCAB, Cluster, collect, finals, request, tokens,
                       unified_reference, until)

pytestmark = pytest.mark.asyncio(loop_scope="module")

BS = 16
SHARED = [(7 * i + 3) % VOCAB for i in range(3 * BS + 5)]  # 3 full blocks + 5
PROMPTS = {
    "short": [5, 9, 13],
    "one-block": list(range(40, 40 + BS)),
    "shared-a": SHARED + [1, 2, 3],
    "shared-b": SHARED + [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],  # prefix hit on the P side
    "long": [(11 * i + 1) % VOCAB for i in range(150)],  # chunked: 64 tokens per step
}
LONG_GEN = msgspec.structs.replace(GREEDY, max_tokens=120)


@pytest.fixture(scope="module")
def reference():
    prompts = dict(PROMPTS, partial=SHARED + list(range(100, 140)))
    expected = unified_reference(prompts)
    expected.update({f"kill-{role}-{i}": unified_reference(
        {"x": PROMPTS["short"] + [i]}, LONG_GEN)["x"] for role in ("decode", "prefill")
        for i in range(3)})
    return expected


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    cluster = await Cluster(("prefill", "decode")).start()
    yield cluster
    await cluster.close()


async def test_split_output_equals_unified(cluster, reference):
    results = await asyncio.gather(*(collect(cluster.client, request(req_id, prompt))
                                     for req_id, prompt in PROMPTS.items()))
    for req_id, deltas in zip(PROMPTS, results):
        assert tokens(deltas) == reference[req_id], req_id
        assert finals(deltas) == [("length", "")]
        assert deltas[-1].num_prompt_tokens == len(PROMPTS[req_id])
    again = await collect(cluster.client, request("shared-a-again", PROMPTS["shared-a"]))
    assert tokens(again) == reference["shared-a"]
    assert again[-1].num_cached_tokens == 3 * BS  # the prefill worker's hit is reported
    await until(lambda: cluster.stat("prefill", "handoff_acked") == len(PROMPTS) + 1
                and cluster.stat("decode", "intake_continued") == len(PROMPTS) + 1)
    assert cluster.stat("prefill", "handoff_failed") == 0
    await until(lambda: cluster.stat("prefill", "handoff_blocks_pinned") == 0)


SEEDED = [msgspec.structs.replace(GREEDY, temperature=1.0, top_p=0.9, seed=seed)
          for seed in (7, 1234)]


async def test_seeded_sampling_survives_the_handoff(cluster):
    """The first token is drawn on the prefill worker, the rest on the decode worker; a seeded
    request still gets the unified engine's tokens (draws are keyed by output position)."""
    for params in SEEDED:
        expected = unified_reference({"x": PROMPTS["shared-a"]}, params)["x"]
        deltas = await collect(cluster.client, request(f"seed-{params.seed}",
                                                       PROMPTS["shared-a"], params))
        assert tokens(deltas) == expected
        assert len(set(expected)) > 3  # really sampled, not a greedy-looking repeat


async def test_only_missing_blocks_travel(cluster, reference):
    sent = cluster.stat("prefill", "handoff_blocks_sent")
    received = cluster.stat("decode", "intake_blocks_received")
    prompt = SHARED + list(range(100, 140))  # the decode worker holds SHARED's 3 blocks
    deltas = await collect(cluster.client, request("partial", prompt))
    assert tokens(deltas) == reference["partial"]
    await until(lambda: cluster.stat("prefill", "handoff_blocks_sent") > sent)
    new_blocks = len(prompt) // BS - 3
    assert cluster.stat("prefill", "handoff_blocks_sent") - sent == new_blocks
    await until(lambda: cluster.stat("decode", "intake_blocks_received") - received
                == new_blocks)


async def test_hostile_kv_frames_are_rejected_and_the_decode_worker_serves_on(cluster,
                                                                               reference):
    address = cluster.worker("decode").kv_address
    offer = KvOffer("ghost", request("ghost", [1, 2]), [b"k" * 16], "float32", [1])
    hostile = [
        [b"\x00\xffgarbage"],
        [b"\x80\x04\x95\n\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s."],  # pickle
        [msgspec.msgpack.encode(["launch", 1])],  # unknown type
        [encode(KvBlocks("ghost", [0], [b"k" * 16], "float32", [1], BS)), b"x" * 10],
        [encode(KvDone("ghost", [1], 0))],  # for an offer never made
        [encode(request("x", [1]))],  # a frontend message on the KV door
        [encode(offer), b"unexpected raw frame"],
    ]
    ctx = zmq.asyncio.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, b"intruder")
    socket.connect(address)
    try:
        for frames in hostile:
            await socket.send_multipart(frames)
        await until(lambda: cluster.stat("decode", "num_rejected_kv_frames") >= len(hostile))
        reply = await asyncio.wait_for(_offer_and_read_reply(socket, offer), 10)
        assert reply[0] == "kv_reject" and "layout" in reply[2]
    finally:
        socket.close(linger=0)
        ctx.term()
    assert cluster.stat("decode", "num_rejected_kv_frames") == len(hostile)
    deltas = await collect(cluster.client, request("after-hostile", PROMPTS["shared-a"]))
    assert tokens(deltas) == reference["shared-a"]


async def _offer_and_read_reply(socket, offer: KvOffer) -> list:
    await socket.send(encode(offer))
    return msgspec.msgpack.decode(await socket.recv())


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_killing_a_worker_mid_stream_recomputes_its_streams(cluster, reference, role):
    victim = cluster.worker(role)
    first_tokens = [asyncio.Event() for _ in range(3)]

    async def consume(i: int):
        deltas = []
        async for delta in cluster.client.generate(
                request(f"kill-{role}-{i}", PROMPTS["short"] + [i], LONG_GEN)):
            deltas.append(delta)
            if len(tokens(deltas)) >= 3:
                first_tokens[i].set()
        return deltas

    tasks = [asyncio.create_task(consume(i)) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 60)
    os.kill(victim.pid, signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for i, deltas in enumerate(results):
        assert finals(deltas) == [("length", "")]
        assert tokens(deltas) == reference[f"kill-{role}-{i}"]
    await until(lambda: role in {r.role for r in cluster.client.workers().values()}
                and cluster.worker(role).pid != victim.pid, timeout_s=120)
    assert not _is_running(victim.pid)
    deltas = await collect(cluster.client, request(f"after-kill-{role}", PROMPTS["long"]))
    assert tokens(deltas) == reference["long"]


def _is_running(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_worker_started_by_hand_joins_and_takes_streams(cluster, reference):
    """`duplex worker --role decode --connect tcp://...` from elsewhere: the router uses it."""
    config = msgspec.json.encode(cluster.supervisor.config).decode()
    process = subprocess.Popen(
        [sys.executable, "-m", "duplex.engine.worker_cli", "--role", "decode", "--connect",
         cluster.client.address, "--worker-id", "by-hand", "--heartbeat-s", "0.2",
         "--config-json", config], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        await until(lambda: "by-hand" in cluster.client.workers(), timeout_s=120)
        prompts = {f"by-hand-{i}": PROMPTS["shared-b"][:40 + i] for i in range(4)}
        expected = unified_reference(prompts)
        results = await asyncio.gather(*(collect(cluster.client, request(req_id, prompt))
                                         for req_id, prompt in prompts.items()))
        assert [tokens(d) for d in results] == list(expected.values())
        stats = cluster.client.worker_stats
        await until(lambda: stats().get("by-hand") is not None
                    and stats()["by-hand"].intake.continued >= 1)
    finally:
        process.kill()
        process.wait()
    await until(lambda: "by-hand" not in cluster.client.workers(), timeout_s=60)

"""An int8 KV cache across the prefill/decode split: the packed blocks travel as they are
(tests/disagg's cluster of real worker processes, tiny Llama), the decode worker continues
from them with the unified int8 engine's tokens, and an offer of another KV precision is
refused by its layout."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from duplex.engine.messages import KvOffer, encode
from tests.disagg.conftest import (VOCAB, Cluster, collect, request, tokens, unified_reference,
                                   until)

pytestmark = pytest.mark.timeout(120)

BS = 16
PROMPTS = {"three-blocks": [(7 * i + 3) % VOCAB for i in range(3 * BS + 5)],
           "long": [(11 * i + 1) % VOCAB for i in range(150)]}


async def test_int8_blocks_hand_off_and_decode_as_in_the_unified_engine():
    expected = unified_reference(PROMPTS, kv_cache_dtype="int8")
    cluster = await Cluster(("prefill", "decode"), kv_cache_dtype="int8").start()
    try:
        results = await asyncio.gather(*(collect(cluster.client, request(req_id, prompt))
                                         for req_id, prompt in PROMPTS.items()))
        for req_id, deltas in zip(PROMPTS, results):
            assert tokens(deltas) == expected[req_id], req_id
        sent = sum(len(p) // BS for p in PROMPTS.values())
        # each worker reports its figures on its own stats beat: wait for both
        await until(lambda: cluster.stat("decode", "intake_blocks_received") == sent)
        await until(lambda: cluster.stat("prefill", "handoff_blocks_sent") == sent)
        # the decode worker continued from those blocks (host-tier hits), not a recompute
        await until(lambda: cluster.stat("decode", "kv_hit_tokens_host") == sent * BS)
        reply = await _offer(cluster.worker("decode").kv_address,
                             KvOffer("bf16", request("bf16", [1, 2]), [b"k" * 16], "bfloat16",
                                     [3, 2, BS, 2, 16]))
        assert reply[0] == "kv_reject" and "layout" in reply[2] and "int8" in reply[2]
    finally:
        await cluster.close()


async def _offer(address: str, offer: KvOffer) -> list:
    ctx = zmq.asyncio.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.connect(address)
    try:
        await socket.send(encode(offer))
        return msgspec.msgpack.decode(await asyncio.wait_for(socket.recv(), 10))
    finally:
        socket.close(linger=0)
        ctx.term()


"""WebSocket API: concurrent requests on one socket, cancel, close, bad frames, schema."""
from __future__ import annotations

import asyncio

import msgspec
from frontend_fakes import FakeEngineClient

from duplex.frontend.protocol import WsServerFrame, ws_json_schema

HI = [{"role": "user", "content": "hi"}]
_frames = msgspec.json.Decoder(WsServerFrame)


async def receive_until_terminal(socket, ids: set[str]) -> dict[str, list]:
    """Frames per id, until every id in `ids` got its terminal frame (each checked typed)."""
    frames: dict[str, list] = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        message = await asyncio.wait_for(socket.receive_str(), 5)
        frame = _frames.decode(message)  # every server frame matches the protocol structs
        frames[frame.id].append(frame)
        if type(frame).__name__ in ("WsDone", "WsError"):
            assert frame.id in open_ids, "a second terminal frame"
            open_ids.discard(frame.id)
    return frames


async def wait_for(predicate, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_concurrent_requests_on_one_socket(make_harness):
    h = await make_harness(FakeEngineClient(reply=lambda m: f"reply {m.params.max_tokens}",
                                            num_cached=3, cached_by_tier={"device": 2, "disk": 1},
                                            draft=(2, 1), batch_invariant=True))
    async with h.client.ws_connect("/v1/ws") as socket:
        for client_id, max_tokens in (("a", 50), ("b", 60)):
            await socket.send_json({"type": "chat", "id": client_id, "messages": HI,
                                    "max_tokens": max_tokens})
        frames = await receive_until_terminal(socket, {"a", "b"})
    for client_id, max_tokens in (("a", 50), ("b", 60)):
        *deltas, done = frames[client_id]
        assert "".join(d.text for d in deltas) == f"reply {max_tokens}"
        assert all(d.num_tokens == 1 and d.draft_proposed == 2 and d.draft_accepted == 1
                   and d.accepted_mask == [True] for d in deltas)
        assert done.finish_reason == "stop" and done.batch_invariant is True
        assert done.usage.cached_tokens == 3
        assert done.usage.cached_tokens_by_tier == {"device": 2, "disk": 1}
        assert done.usage.completion_tokens == len(f"reply {max_tokens}")
        assert done.timings.e2e_s >= done.timings.ttft_s >= 0


async def test_cancel_aborts_and_sends_one_terminal_frame(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.05))
    async with h.client.ws_connect("/v1/ws") as socket:
        await socket.send_json({"type": "chat", "id": "slow", "messages": HI})
        await socket.send_json({"type": "chat", "id": "other", "messages": HI,
                                "max_tokens": 2})
        first = _frames.decode(await socket.receive_str())
        assert type(first).__name__ == "WsDelta"
        await socket.send_json({"type": "cancel", "id": "slow"})
        frames = await receive_until_terminal(socket, {"slow", "other"})
        assert frames["slow"][-1].code == "cancelled"
        assert frames["other"][-1].finish_reason == "length"
        await socket.send_json({"type": "cancel", "id": "unknown"})  # ignored
        await socket.send_json({"type": "ping"})
        assert _frames.decode(await socket.receive_str()) == msgspec.json.decode(
            b'{"type":"pong"}', type=WsServerFrame)
    slow_id = next(m.req_id for m in h.engine.added if m.params.max_tokens != 2)
    assert slow_id in h.engine.aborted


async def test_closing_the_socket_aborts_its_requests(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.05))
    socket = await h.client.ws_connect("/v1/ws")
    await socket.send_json({"type": "chat", "id": "x", "messages": HI})
    await socket.send_json({"type": "chat", "id": "y", "messages": HI})
    await socket.receive_str()
    await socket.close()
    await wait_for(lambda: len(h.engine.aborted) == 2)
    await wait_for(lambda: h.state.admission.num_active == 0)


async def test_bad_frames_get_error_frames_and_the_socket_stays_open(harness):
    async with harness.client.ws_connect("/v1/ws") as socket:
        cases = [("not json", None, "invalid_request"),
                 ('{"type": "chat", "id": "q"}', "q", "invalid_request"),
                 ('{"type": "dance", "id": "d"}', "d", "invalid_request"),
                 ('{"type": "chat", "id": "r", "messages": [{"role": "x", "content": ""}]}', "r",
                  "invalid_request"),
                 ('{"type": "chat", "id": "t", "messages": [], "max_tokens": 5}', "t",
                  "invalid_request"),
                 ('{"type": "chat", "id": "u", "messages": [{"role": "user", "content": "a"}],'
                  ' "max_tokens": 100000}', "u", "invalid_request")]
        for text, client_id, code in cases:
            await socket.send_str(text)
            frame = _frames.decode(await socket.receive_str())
            assert type(frame).__name__ == "WsError", text
            assert (frame.id, frame.code) == (client_id, code), text
        await socket.send_bytes(b"\x00")
        assert _frames.decode(await socket.receive_str()).code == "invalid_request"
        await socket.send_json({"type": "chat", "id": "ok", "messages": HI})
        frames = await receive_until_terminal(socket, {"ok"})
        assert frames["ok"][-1].finish_reason == "stop"


async def test_duplicate_id_is_refused(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.02))
    async with h.client.ws_connect("/v1/ws") as socket:
        await socket.send_json({"type": "chat", "id": "same", "messages": HI, "max_tokens": 3})
        await socket.send_json({"type": "chat", "id": "same", "messages": HI})
        frame = _frames.decode(await socket.receive_str())
        assert type(frame).__name__ == "WsError" and "already running" in frame.message
        frames = await receive_until_terminal(socket, {"same"})
        assert frames["same"][-1].finish_reason == "length"


async def test_worker_death_gives_one_error_frame(make_harness):
    engine = FakeEngineClient()
    engine.fail_after = 2
    h = await make_harness(engine)
    async with h.client.ws_connect("/v1/ws") as socket:
        await socket.send_json({"type": "chat", "id": "w", "messages": HI})
        frames = await receive_until_terminal(socket, {"w"})
    assert [type(f).__name__ for f in frames["w"]] == ["WsDelta", "WsDelta", "WsError"]
    assert frames["w"][-1].code == "unavailable"


def test_ws_json_schema_describes_every_frame():
    schema = ws_json_schema()
    names = set(schema["$defs"])
    assert {"WsChat", "WsCancel", "WsPing", "WsDelta", "WsDone", "WsError", "WsPong",
            "WsUsage", "WsTimings"} <= names
    assert schema["$defs"]["WsChat"]["properties"]["type"]["enum"] == ["chat"]
    assert "messages" in schema["$defs"]["WsChat"]["required"]
    encoded = msgspec.json.encode(schema)  # plain JSON
    for ref in _refs(msgspec.json.decode(encoded)):
        assert ref.removeprefix("#/$defs/") in names


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


async def test_app_shutdown_closes_sockets_and_aborts(make_harness):
    h = await make_harness(FakeEngineClient(step_s=0.05))
    socket = await h.client.ws_connect("/v1/ws")
    await socket.send_json({"type": "chat", "id": "s", "messages": HI})
    await socket.receive_str()
    await h.client.app.shutdown()
    message = await asyncio.wait_for(socket.receive(), 2)
    assert message.type.name in ("CLOSE", "CLOSED") and socket.close_code == 1001
    await wait_for(lambda: h.engine.aborted == [h.engine.added[0].req_id])

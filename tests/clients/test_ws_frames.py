"""The committed JSON Schema (docs/ws-schema.json) describes what the server really sends and
what `duplex chat` really sends: frames recorded from a fake-engine exchange are checked
against it (a real-model exchange is checked in test_real_server.py)."""
from __future__ import annotations

import json

import pytest
from client_support import REPO, FakeEngineClient, record_exchange
from schema_check import errors

from duplex.frontend.chat import Conversation

SCHEMA = json.loads((REPO / "docs" / "ws-schema.json").read_text())


def assert_server_frames_conform(frames: list[dict]) -> None:
    server = SCHEMA["properties"]["server"]
    for frame in frames:
        assert errors(frame, server, SCHEMA) == [], frame
    kinds = {(f["type"], f.get("code")) for f in frames}
    assert {("delta", None), ("done", None), ("pong", None), ("error", "cancelled"),
            ("error", "invalid_request")} <= kinds
    assert any(f["type"] == "error" and f["id"] is None for f in frames)


def test_frames_of_a_fake_exchange_match_the_schema(make_server):
    server = make_server(FakeEngineClient(reply="word " * 100, step_s=0.01, num_cached=3,
                                          cached_by_tier={"device": 2, "disk": 1}, draft=(3, 2),
                                          batch_invariant=True))
    frames = record_exchange(server.ws_url)
    assert_server_frames_conform(frames)
    done = next(f for f in frames if f["type"] == "done")
    assert done["usage"]["cached_tokens_by_tier"] == {"device": 2, "disk": 1}
    assert any(f["type"] == "delta" and f["accepted_mask"] for f in frames)


def test_the_checker_rejects_what_the_schema_forbids():
    server = SCHEMA["properties"]["server"]
    pong = {"type": "pong"}
    assert errors(pong, server, SCHEMA) == []
    for bad in ({"type": "pang"}, {"type": "pong", "extra": 1},
                {"type": "delta", "id": "1", "text": "x", "num_tokens": "1"},
                {"type": "error", "code": "x", "message": "y"}):
        assert errors(bad, server, SCHEMA), bad


@pytest.mark.parametrize("params", [{}, {"temperature": 0.5, "max_tokens": 9, "stop": ["x"]}])
def test_chat_client_frames_match_the_schema(params):
    conversation = Conversation("be brief", params)
    conversation.add_turn("hi", "hello")
    client = SCHEMA["properties"]["client"]
    assert errors(conversation.request("again"), client, SCHEMA) == []
    assert errors({"type": "cancel", "id": "1"}, client, SCHEMA) == []

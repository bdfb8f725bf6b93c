"""API keys on the paths a browser uses: the WebSocket's subprotocol key (never a URL
parameter), /metrics behind the key unless metrics_public, and the key never in a log line."""
from __future__ import annotations

import base64
import logging

import aiohttp
import pytest

from duplex.frontend.auth import WS_KEY_PREFIX, WS_PROTOCOL


def key_protocol(key: str) -> str:
    return WS_KEY_PREFIX + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


async def test_websocket_takes_the_key_as_a_subprotocol(make_harness):
    h = await make_harness(api_keys=("sésame-1",))
    async with h.client.ws_connect("/v1/ws", protocols=(WS_PROTOCOL, key_protocol("sésame-1"))
                                   ) as socket:
        assert socket.protocol == WS_PROTOCOL  # the server selects ours, never the key's
        await socket.send_json({"type": "ping"})
        assert (await socket.receive_json())["type"] == "pong"
    for protocols in ((WS_PROTOCOL, key_protocol("wrong")), (WS_PROTOCOL, WS_KEY_PREFIX + "!!"),
                      (WS_PROTOCOL,)):
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await h.client.ws_connect("/v1/ws", protocols=protocols)
        assert e.value.status == 401


async def test_a_key_in_the_url_is_refused_and_never_logged(make_harness, caplog):
    h = await make_harness(api_keys=("secret-key-7",))
    caplog.set_level(logging.DEBUG)
    with pytest.raises(aiohttp.WSServerHandshakeError):
        await h.client.ws_connect("/v1/ws?api_key=secret-key-7")
    response = await h.client.get("/v1/models?api_key=secret-key-7")
    assert response.status == 401
    assert (await response.json())["error"]["code"] == "invalid_api_key"
    # duplex's own lines (`duplex serve` runs aiohttp with access_log=None)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("duplex")]
    assert ours and not any("secret-key-7" in line for line in ours)


async def test_open_server_still_answers_a_client_offering_the_subprotocol(harness):
    async with harness.client.ws_connect("/v1/ws", protocols=(WS_PROTOCOL,)) as socket:
        assert socket.protocol == WS_PROTOCOL
    async with harness.client.ws_connect("/v1/ws") as socket:  # no subprotocol: none chosen
        assert socket.protocol is None


@pytest.mark.parametrize("metrics_public", [False, True])
async def test_metrics_behind_the_key_unless_public(make_harness, metrics_public):
    h = await make_harness(api_keys=("k",), metrics_public=metrics_public)
    response = await h.client.get("/metrics")
    assert response.status == (200 if metrics_public else 401)
    if not metrics_public:
        assert (await response.json())["error"]["code"] == "invalid_api_key"
    response = await h.client.get("/metrics", headers={"Authorization": "Bearer k"})
    assert response.status == 200 and "duplex_requests" in await response.text()
    assert (await h.client.get("/health")).status == 200

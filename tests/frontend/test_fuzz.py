"""Hypothesis fuzzing of every JSON endpoint: whatever the body, never a 5xx, and every
4xx is in the called API's error shape. The server runs on its own loop in a thread."""
from __future__ import annotations

import asyncio
import collections
import json
import threading

import pytest
import requests
from aiohttp import web
from frontend_fakes import FakeEngineClient, FakeRecipe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex.bench.fuzz_bodies import (RAW_PATHS, chat_body, completion_body, deep_body,
                               messages_body, problem, raw_body)
from duplex.frontend.server import AppState, ServerOptions, build_app

STATUSES: collections.Counter = collections.Counter()  # (path, status) -> count
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server_url():
    loop = asyncio.new_event_loop()
    state = AppState(FakeEngineClient(max_model_len=256), FakeRecipe(), ServerOptions())
    runner = web.AppRunner(build_app(state), handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def check(url: str, path: str, body: bytes | dict) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = requests.post(url + path, data=data, timeout=10,
                             headers={"Content-Type": "application/json"})
    STATUSES[path, response.status_code] += 1
    wrong = problem(path, response.status_code, response.headers["Content-Type"], response.text)
    assert wrong is None, (wrong, body)


@SETTINGS
@given(body=chat_body)
def test_fuzz_chat(server_url, body):
    check(server_url, "/v1/chat/completions", body)


@SETTINGS
@given(body=completion_body)
def test_fuzz_completions(server_url, body):
    check(server_url, "/v1/completions", body)


@SETTINGS
@given(body=messages_body)
def test_fuzz_messages(server_url, body):
    check(server_url, "/v1/messages", body)
    check(server_url, "/v1/messages/count_tokens", body)


@SETTINGS
@given(body=raw_body, path=st.sampled_from(RAW_PATHS))
def test_fuzz_raw_bodies(server_url, body, path):
    check(server_url, path, body)


@settings(SETTINGS, max_examples=12)
@given(body=deep_body, path=st.sampled_from(RAW_PATHS))
def test_fuzz_deeply_nested_bodies(server_url, body, path):
    check(server_url, path, body)


def test_fuzzing_reached_the_engine():
    """Runs after the fuzz tests above: a good share of bodies must be valid, or the fuzzing
    only exercised validation."""
    if not STATUSES:
        pytest.skip("run with the fuzz tests")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        assert STATUSES[path, 200] >= 10, sorted(STATUSES.items())

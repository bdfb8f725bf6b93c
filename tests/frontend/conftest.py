"""Fixtures for the frontend tests: an app on a real 127.0.0.1 port over fake engine + recipe."""
from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer
from frontend_fakes import FakeEngineClient, FakeRecipe
from reasoning_support import reasoning_recipes

from duplex.frontend.server import AppState, ServerOptions, build_app


class Harness:
    """One running test server and the fakes behind it."""

    def __init__(self, state: AppState, client: TestClient) -> None:
        self.state = state
        self.client = client
        self.engine: FakeEngineClient = state.engine
        self.recipe: FakeRecipe = state.recipe

    @property
    def base_url(self) -> str:
        return str(self.client.make_url("/v1"))

    async def post(self, path: str, body=None, **kwargs):
        return await self.client.post(path, json=body, **kwargs)


@pytest.fixture
async def make_harness():
    started: list[TestClient] = []

    async def make(engine: FakeEngineClient | None = None, **options) -> Harness:
        state = AppState(engine or FakeEngineClient(), FakeRecipe(), ServerOptions(**options))
        client = TestClient(TestServer(build_app(state), host="127.0.0.1"))
        await client.start_server()
        started.append(client)
        return Harness(state, client)

    yield make
    for client in started:
        await client.close()


@pytest.fixture
async def harness(make_harness) -> Harness:
    return await make_harness()


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """The R1-Distill and Qwen3 reasoning recipes (reasoning_support.py), by name."""
    return reasoning_recipes(tmp_path_factory)

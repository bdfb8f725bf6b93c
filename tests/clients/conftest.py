"""Fixtures for the client tests: fake-engine servers on their own threads."""
from __future__ import annotations

import socket

import pytest
from client_support import FakeEngineClient, ServerThread


@pytest.fixture
def make_server():
    servers: list[ServerThread] = []

    def make(engine: FakeEngineClient | None = None, **options) -> ServerThread:
        servers.append(ServerThread(engine or FakeEngineClient(), **options).start())
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def server(make_server) -> ServerThread:
    return make_server()


@pytest.fixture
def unused_port() -> int:
    """A port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

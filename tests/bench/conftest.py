"""Fixtures for the benchmark tests: the default model's tokenizer and a fake OpenAI server."""
from __future__ import annotations

import socket

import pytest
from bench_fakes import FakeOpenAI

from duplex.bench.hf import load_tokenizer
from duplex.bench.text import TextSource


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def text_source(tokenizer) -> TextSource:
    return TextSource(tokenizer, seed=0)


@pytest.fixture
def fake_server():
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL where nothing listens (the port was bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"

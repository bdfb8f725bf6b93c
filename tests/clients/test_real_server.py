"""Against the real `duplex serve` with the default model (one server for the module): the
SDK examples, `duplex chat` through a pipe, and the schema check of recorded frames."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from client_support import REPO, RealServer, client_env, record_exchange
from test_ws_frames import assert_server_frames_conform

from duplex.engine.config import DEFAULT_MODEL_PACKAGE

STARTUP_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="default model not installed")]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    server = RealServer(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        server.wait_healthy(STARTUP_S)
        yield server
    finally:
        server.stop()


def run(server, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, cwd=REPO,
                            timeout=280, env=client_env(DUPLEX_URL=server.url))
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_frames_of_a_real_exchange_match_the_schema(real_server):
    frames = record_exchange(real_server.url.replace("http", "ws") + "/v1/ws", timeout_s=120)
    assert_server_frames_conform(frames)


def test_chat_pipe_answers_with_the_real_model(real_server):
    result = run(real_server, sys.executable, "-m", "duplex.frontend.cli", "chat", "--url",
                 real_server.url, "--max-tokens", "8", "--temperature", "0",
                 stdin="What is the capital of France?")
    assert "Paris" in result.stdout and result.stdout.endswith("\n")
    assert result.stderr.startswith("[ttft ") and "prompt tokens cached" in result.stderr


def test_openai_sdk_example(real_server):
    out = run(real_server, sys.executable, "examples/openai_chat.py").stdout
    assert "Paris" in out.split("== streaming ==")[0]
    assert "(cached prompt tokens: " in out and "== tools ==\n" in out


def test_anthropic_sdk_example(real_server):
    out = run(real_server, sys.executable, "examples/anthropic_messages.py").stdout
    message, streamed = out.split("== streaming ==\n")
    assert "(stop: " in message and "(cache_read_input_tokens: " in streamed
    text = message.removeprefix("== message ==\n").split("\n(stop: ")[0]
    assert streamed.startswith(text)  # greedy: the stream repeats the answer

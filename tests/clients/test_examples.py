"""Every file in examples/ runs against a test server (fake engine, API key on) and prints
what it promises; README.md points at each one."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from client_support import REPO, FakeEngineClient, client_env
from frontend_fakes import OFFSET

EXAMPLES = REPO / "examples"
KEY = "example-key"


def reply(msg) -> str:
    """Call the weather tool when tools are offered, then answer from the tool's result."""
    text = bytes(i - OFFSET for i in msg.prompt_token_ids if i >= OFFSET).decode()
    if "<tool>" in text:
        return "It is sunny in Paris."
    if "<tools>" in text:
        return '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    return "Paris is the capital."


@pytest.fixture(scope="module")
def keyed_server():
    from client_support import ServerThread
    server = ServerThread(FakeEngineClient(reply=reply, num_cached=5), api_keys=(KEY,)).start()
    yield server
    server.close()


def run_example(server, *argv: str) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, cwd=REPO, timeout=60,
                            env=client_env(DUPLEX_URL=server.url, DUPLEX_API_KEY=KEY))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_openai_chat(keyed_server):
    out = run_example(keyed_server, sys.executable, "examples/openai_chat.py")
    assert "== chat ==\nParis is the capital.\n(prompt " in out
    assert "5 of them from the KV cache" in out
    assert "== streaming ==\nParis is the capital.\n(cached prompt tokens: 5)" in out
    assert ("tool call: get_weather({\"city\": \"Paris\"}) -> {'city': 'Paris', 'sky': 'sunny', "
            "'celsius': 21}\nIt is sunny in Paris.") in out


def test_anthropic_messages(keyed_server):
    out = run_example(keyed_server, sys.executable, "examples/anthropic_messages.py")
    assert "== message ==\nParis is the capital.\n(stop: end_turn;" in out
    assert "== streaming ==\nParis is the capital.\n(cache_read_input_tokens: 5)" in out


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_sse(keyed_server):
    out = run_example(keyed_server, "bash", "examples/curl_sse.sh")
    assert out.count("data: [DONE]") == 1 and '"content":"P"' in out
    assert "event: message_stop" in out and '"text":"P"' in out


def test_ws_client_py(keyed_server):
    out = run_example(keyed_server, sys.executable, "examples/ws_client.py", "hi")
    assert out.startswith("Paris is the capital.\n(finish: stop; ")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_ws_client_mjs(keyed_server):
    out = run_example(keyed_server, "node", "--experimental-websocket", "examples/ws_client.mjs",
                      "hi")
    assert out.startswith("Paris is the capital.\n(finish: stop; ")


def test_every_example_is_tested_and_pointed_at():
    usage = (REPO / "README.md").read_text()
    tested = {"openai_chat.py", "anthropic_messages.py", "curl_sse.sh", "ws_client.py",
              "ws_client.mjs"}
    assert {p.name for p in EXAMPLES.iterdir() if p.is_file()} == tested
    assert all(f"examples/{name}" in usage for name in tested)

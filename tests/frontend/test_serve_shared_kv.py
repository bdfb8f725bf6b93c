"""Two `duplex serve` processes (each its own frontend and worker, as on two hosts) share one
real redis-server through `--kv-remote`: a conversation started on one and continued on the
other hits the shared tier on its first request there, reports those tokens in usage, and
answers token for token what the first server answers."""
from __future__ import annotations

import importlib.util
import time

import pytest

from duplex.engine.config import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE
from tests.frontend.test_e2e_serve import Server, oai

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="default model not installed")]

QUESTION = ("Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, "
            "honeydew, kiwi, lemon, mango, nectarine, orange, papaya. Which one is yellow?")


def shared_server(tmp_dir, store_url: str) -> Server:
    """test_e2e_serve's server, on the shared store."""
    tmp_dir.mkdir()
    return Server(tmp_dir, ("--kv-remote", store_url))


def _ask(server: Server, messages: list[dict]) -> tuple[str, int]:
    reply = oai(server).chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages,
                                                 max_tokens=12, temperature=0)
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def _wait_written(store, timeout_s: float = 60.0) -> int:
    """Writes go behind the steps: wait until the store's key count stops growing."""
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        size = int(store.command("DBSIZE").strip().lstrip(b":"))  # RESP ":5\r\n"
        if size and size == last:
            return size
        last = size
        time.sleep(1.0)
    raise AssertionError(f"the store holds {last} keys after {timeout_s} s")


@pytest.fixture
def two_servers(tmp_path, redis_factory):
    store = redis_factory()
    servers = [shared_server(tmp_path / name, store.url) for name in ("a", "b")]
    try:
        for server in servers:
            server.wait_announced()
        yield store, servers
    finally:
        for server in servers:
            server.stop()


def test_conversation_continued_on_another_server_hits_the_shared_tier(two_servers):
    store, (first, second) = two_servers
    turn1 = [{"role": "user", "content": QUESTION}]
    answer, cached = _ask(first, turn1)
    assert cached == 0, "a cold store"
    assert _wait_written(store) > 0
    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "And which one is orange?"}]
    on_second, cached_second = _ask(second, turn2)  # the second server's first request
    assert cached_second >= 32, f"only {cached_second} tokens came from the shared tier"
    on_first, _ = _ask(first, turn2)
    assert on_second == on_first


"""Retention end to end: the `x-duplex-retention` header and the `retention` body field pass
from the HTTP API (official SDKs) through the frontend to a real EngineCore with a disk tier,
and the block files it writes expire on that class's TTL (agent 3 d, chat 7 d). Bad values
are 400s in the API's own shape, and the worker refuses an unknown class too."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import anthropic
import msgspec
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from duplex.frontend.server import AppState, ServerOptions, build_app
from duplex.kvstore import blockfile
from tests.disagg.conftest import tiny_model
from tests.engine.conftest import make_core

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
from frontend_fakes import OFFSET, FakeEngineClient, FakeRecipe  # noqa: E402

DAY_S = 86_400.0
HI = [{"role": "user", "content": "tell me a long story about caches " * 2}]


@pytest.fixture(scope="module")
def default_model() -> str:
    """A tiny random Llama (vocab 384 covers the fake recipe's byte tokens)."""
    return tiny_model()


class CoreEngine(FakeEngineClient):
    """The frontend's engine client, answered by a real in-process EngineCore."""

    def __init__(self, core) -> None:
        super().__init__()
        self.core = core

    async def _deltas(self, msg: AddRequest):
        self.core.add_request(msg)
        while self.core.has_unfinished_requests():
            for delta in self.core.step():  # tiny-model ids as the fake recipe's byte tokens
                yield msgspec.structs.replace(
                    delta, new_token_ids=[OFFSET + t % 256 for t in delta.new_token_ids])


@pytest.fixture
async def served(default_model, tmp_path):
    core = make_core(default_model, block_size=8, num_kv_blocks=64, kv_dir=str(tmp_path),
                     kv_disk_bytes=64 << 20)
    state = AppState(CoreEngine(core), FakeRecipe(), ServerOptions())
    client = TestClient(TestServer(build_app(state), host="127.0.0.1"))
    await client.start_server()
    yield client, core, tmp_path
    await client.close()
    core.close()


def expiries(core, root: Path) -> list[float]:
    """expires_at of every block file the disk tier has written so far."""
    core.tiers.flush()
    found = []
    for path in root.rglob("*"):
        if path.is_file() and len(path.name) == 32:
            head = path.read_bytes()[:blockfile.HEADER_BYTES]
            found.append(blockfile._FIELDS.unpack_from(head)[5])
    return found


def ttl_class(stamps: list[float], t0: float) -> set[float]:
    """Each expiry as whole days after t0."""
    return {round((s - t0) / DAY_S) for s in stamps}


async def test_agent_header_gives_agent_ttl_on_disk(served):
    client, core, root = served
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x")
    t0 = time.time()
    await sdk.chat.completions.create(model="fake-model", messages=HI, max_tokens=2,
                                      extra_headers={"x-duplex-retention": "agent"})
    assert ttl_class(expiries(core, root), t0) == {3}


async def test_body_field_and_default_classes(served):
    client, core, root = served
    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="x")
    t0 = time.time()
    await sdk.messages.create(model="fake-model", messages=HI, max_tokens=2)
    assert ttl_class(expiries(core, root), t0) == {7}, "no header, no tools: chat"
    await sdk.messages.create(model="fake-model", max_tokens=2, extra_body={"retention": "agent"},
                              messages=[{"role": "user", "content": "agent work " * 8}])
    assert ttl_class(expiries(core, root), t0) == {3, 7}


async def test_tools_make_agent_traffic(served):
    client, core, root = served
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x")
    t0 = time.time()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    # tool_choice "none": tools offered still make agent traffic, and no tool-call grammar
    # is built (the tiny random model has no tokenizer for one)
    await sdk.chat.completions.create(model="fake-model", messages=HI, max_tokens=2,
                                      tools=[tool], tool_choice="none")
    assert ttl_class(expiries(core, root), t0) == {3}


@pytest.mark.parametrize("headers, body, param", [
    ({"x-duplex-retention": "forever"}, {}, "x-duplex-retention"),
    ({}, {"retention": "forever"}, "retention"),
    ({"x-duplex-retention": "agent"}, {"retention": "chat"}, "retention"),
])
async def test_bad_retention_is_a_400_in_each_api_shape(served, headers, body, param):
    client, _, _ = served
    oa = await client.post("/v1/chat/completions", headers=headers,
                           json={"model": "fake-model", "messages": HI, **body})
    assert oa.status == 400
    error = (await oa.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    an = await client.post("/v1/messages", headers=headers,
                           json={"model": "fake-model", "messages": HI, "max_tokens": 2, **body})
    assert an.status == 400
    reply = await an.json()
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"


def test_worker_refuses_an_unknown_class(default_model):
    core = make_core(default_model, block_size=8, num_kv_blocks=16)
    with pytest.raises(ValueError, match="unknown retention class 'forever'"):
        core.add_request(AddRequest("r", [5, 6, 7], SamplingParams(max_tokens=1),
                                    retention="forever"))
    core.close()

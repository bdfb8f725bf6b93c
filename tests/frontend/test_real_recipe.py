"""The API over the real recipe of the default model (tokenizer and chat template from the
GGUF file) and a fake engine: prompts tokenize as the recipe says, hostile templates are 400."""
from __future__ import annotations

import importlib.util
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from frontend_fakes import FakeEngineClient

from duplex.engine.config import DEFAULT_MODEL_PACKAGE, default_model_path
from duplex.engine.text.messages import Chat
from duplex.frontend.server import AppState, ServerOptions, build_app

pytestmark = pytest.mark.skipif(importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None,
                                reason="default model not installed")
HI = [{"role": "user", "content": "Hi <|im_end|> there"}]
HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{% set ns = namespace(a='x') %}{% for i in range(64) %}{% set ns.a = ns.a ~ ns.a %}"
    "{% endfor %}{{ ns.a }}",
    "{{ raise_exception('no') }}",
    "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
    "{{ unclosed",
]


@pytest.fixture
async def real(tmp_path):
    from duplex.engine.text.recipe import Recipe
    recipe = Recipe.from_model(default_model_path())
    state = AppState(FakeEngineClient(max_model_len=8192), recipe,
                     ServerOptions(web_dir=tmp_path, allow_request_chat_template=True))
    client = TestClient(TestServer(build_app(state), host="127.0.0.1"))
    await client.start_server()
    yield state, client
    await client.close()


async def test_prompt_ids_are_the_recipes(real):
    state, client = real
    response = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert response.status == 200
    assert state.engine.added[-1].prompt_token_ids == state.recipe.encode_chat(Chat.from_dicts(HI))
    assert state.engine.added[-1].params.stop_token_ids == list(state.recipe.eos_token_ids)
    tokens = await (await client.post("/tokenize", json={"messages": HI})).json()
    assert tokens["tokens"] == state.recipe.encode_chat(Chat.from_dicts(HI))
    count = await (await client.post("/v1/messages/count_tokens",
                                     json={"model": "fake-model", "messages": HI})).json()
    assert count["input_tokens"] == len(tokens["tokens"])


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
async def test_hostile_client_template_is_400(real, template):
    _, client = real
    start = time.monotonic()
    response = await client.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 2, "chat_template": template})
    assert response.status == 400, await response.text()
    assert (await response.json())["error"]["param"] == "messages"
    assert time.monotonic() - start < 10

"""A test server for reasoning models: the real recipe of a DeepSeek-R1-Distill-Qwen or Qwen3
tokenizer (tests/text/reasoning_models.py, no hub) over a scripted engine.

The test hook: `ScriptedEngine(script)` answers each request with `script(prompt_text,
output_text)` tokenized as the model would write it (think markers as their tokens);
`output_text` is what the request's output already holds (a thinking-budget continuation
starts with the tokens so far and the closing marker), so a script can answer a
continuation differently from a fresh request.
"""
from __future__ import annotations

import contextlib

import anthropic
import openai
from aiohttp.test_utils import TestClient, TestServer
from frontend_fakes import FakeEngineClient

from duplex.engine.config import default_model_path
from duplex.engine.text.recipe import Recipe
from duplex.frontend.server import AppState, ServerOptions, build_app
from tests.text.reasoning_models import qwen3_tokenizer_dir, r1_tokenizer_dir


class ScriptedEngine(FakeEngineClient):
    def __init__(self, recipe: Recipe, script, **kwargs) -> None:
        super().__init__(**kwargs)
        self.recipe = recipe
        self.script = script

    def reply_ids(self, msg) -> list[int]:
        prompt = self.recipe.decode(msg.prompt_token_ids, skip_special_tokens=False)
        output = self.recipe.decode(msg.output_token_ids, skip_special_tokens=False)
        return self.recipe.encode_reply_start(self.script(prompt, output))


def reasoning_recipes(tmp_path_factory) -> dict[str, Recipe]:
    tokenizer = Recipe.from_model(default_model_path()).tokenizer
    return {"r1": Recipe.from_model(r1_tokenizer_dir(tmp_path_factory.mktemp("r1"), tokenizer)),
            "qwen3": Recipe.from_model(qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3"),
                                                           tokenizer))}


async def start_server(recipe: Recipe, script, started: list, **options):
    """(the app's state, a started TestClient) over ScriptedEngine(recipe, script)."""
    engine = ScriptedEngine(recipe, script)
    state = AppState(engine, recipe, ServerOptions(**options))
    client = TestClient(TestServer(build_app(state), host="127.0.0.1"))
    await client.start_server()
    started.append(client)
    return state, client


def openai_sdk(client: TestClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)


def anthropic_sdk(client: TestClient) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="none",
                                    max_retries=0)


@contextlib.asynccontextmanager
async def sdk_servers(sdk):
    """make(recipe, script, **options) -> (the app's state, sdk(its TestClient)); every server
    made is closed on exit."""
    started: list = []

    async def make(recipe, script, **options):
        state, client = await start_server(recipe, script, started, **options)
        return state, sdk(client)

    try:
        yield make
    finally:
        for client in started:
            await client.close()

"""A test server whose model output is steered by a script and held to the request's grammar.

The test hook: `SteeredEngine(recipe, script, grammars)` answers a request with
`script(prompt_text)` tokenized as the model would write it, one token per step, the way a
model that prefers exactly that text would: each token goes through the request's constraint
(the real engine/grammar.py `Grammars`, compiled against the real tokenizer), and where the
grammar refuses the scripted token the output ends (end of output, when the grammar allows
it). So a script that repeats a tool call shows what the constraint lets through; a script
the grammar can neither take nor end is a test error, never a silent pass. max_tokens cuts
the output as the engine does (finish reason length).
With `sees_output` the script is `script(prompt_text, output_text)`: `output_text` is what
the request's output already holds (a thinking-budget continuation brings the thinking so far
and the closing marker, which the grammar replays as the engine's does).

The recipe is real: a tiny byte-level BPE tokenizer (tests/structured/conftest.py, trained
here, no hub) with SmolLM2's Hermes tool-calling template (frontend/templates/), so prompts,
the forced start of a tool call and the detokenized text are the server's own.
"""
from __future__ import annotations

import types

from aiohttp.test_utils import TestClient, TestServer
from frontend_fakes import FakeEngineClient

from duplex.engine.grammar import Grammars
from duplex.engine.messages import AddRequest, FinishReason, RequestDelta
from duplex.engine.text.recipe import Recipe
from duplex.frontend.serve import TOOLS_TEMPLATE
from duplex.frontend.server import AppState, ServerOptions, build_app
from tests.structured.conftest import tiny_tokenizer


def tools_recipe(directory) -> Recipe:
    """The tiny tokenizer with the Hermes tool-calling template, saved in `directory`."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE.read_text(encoding="utf-8")
    tokenizer.save_pretrained(directory)
    return Recipe.from_model(str(directory))


def recipe_grammars(recipe: Recipe) -> Grammars:
    """Grammars compiled against the recipe's tokenizer, each compile awaited on submit."""
    return Grammars(lambda: recipe.tokenizer, recipe.vocab_size, recipe.eos_token_ids,
                    blocking=True)


class SteeredEngine(FakeEngineClient):
    def __init__(self, recipe: Recipe, script, grammars: Grammars,
                 sees_output: bool = False) -> None:
        super().__init__(max_model_len=4096)
        self.recipe, self.script, self.grammars = recipe, script, grammars
        self.sees_output = sees_output
        self.eos = recipe.eos_token_ids[0]

    async def _deltas(self, msg: AddRequest):
        num_brought = len(msg.output_token_ids)
        wanted = self.recipe.encode_reply_start(self._script(msg)) + [self.eos]
        req = types.SimpleNamespace(req_id=msg.req_id, params=msg.params,
                                    output_token_ids=list(msg.output_token_ids))
        if msg.params.constraint is not None:
            self.grammars.submit(req)
            ready, failed = self.grammars.take_ready()
            assert ready == [req] and not failed, failed
        try:
            for i in range(num_brought, msg.params.max_tokens):
                token_id = self._next(req, wanted[i - num_brought])
                if token_id == self.eos:
                    yield self._delta(msg, [], FinishReason.STOP)
                    return
                req.output_token_ids.append(token_id)
                is_last = i + 1 == msg.params.max_tokens
                yield self._delta(msg, [token_id], FinishReason.LENGTH if is_last else None)
        finally:
            self.grammars.free(req.req_id)

    def _script(self, msg: AddRequest) -> str:
        prompt = self.recipe.decode(msg.prompt_token_ids, skip_special_tokens=False)
        if not self.sees_output:
            return self.script(prompt)
        return self.script(prompt, self.recipe.decode(msg.output_token_ids,
                                                      skip_special_tokens=False))

    def _next(self, req, token_id: int) -> int:
        """The scripted token where the grammar takes it, else end of output."""
        if not self.grammars.has(req):
            return token_id
        [allowed] = self.grammars.masks([req]).allowed
        if allowed[token_id]:
            return token_id
        assert allowed[self.eos], (
            f"the script leaves the grammar after {self.recipe.decode(req.output_token_ids)!r}")
        return self.eos

    def _delta(self, msg: AddRequest, token_ids: list[int],
               finish: FinishReason | None) -> RequestDelta:
        return RequestDelta(msg.req_id, token_ids, finish_reason=finish,
                            stop_reason=self.eos if finish == FinishReason.STOP else None,
                            num_prompt_tokens=len(msg.prompt_token_ids))


async def start_server(recipe: Recipe, script, grammars: Grammars, started: list,
                       sees_output: bool = False,
                       **options) -> tuple[SteeredEngine, TestClient]:
    """(the engine, a started TestClient) of the real app over SteeredEngine."""
    engine = SteeredEngine(recipe, script, grammars, sees_output)
    state = AppState(engine, recipe, ServerOptions(**options))
    client = TestClient(TestServer(build_app(state), host="127.0.0.1"))
    await client.start_server()
    started.append(client)
    return engine, client

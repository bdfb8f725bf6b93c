"""The server the third-party client tests drive, and the clients' offline switches.

`SteeredServer`: the real app over the steered engine (tests/frontend/steered_support.py: a
tiny tokenizer with the Hermes tool template, the script's text held to the request's
grammar) on its own event-loop thread at 127.0.0.1, so sync clients and async clients on
the test's loop alike can call it. A test sets `server.script` to what the model writes.

Imported before any client: it turns off what the clients would send elsewhere (agents'
trace export, LangSmith runs, litellm's cost-map download); these off-switches stay set for
the test process.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

os.environ.update(OPENAI_AGENTS_DISABLE_TRACING="1", LANGSMITH_TRACING="false",
                  LANGCHAIN_TRACING_V2="false", LITELLM_LOCAL_MODEL_COST_MAP="True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))  # steered_support

from steered_support import start_server  # noqa: E402

MODEL = "fake-model"
REPLY_START = "<|im_start|>assistant\n"


def call(name: str, arguments: str) -> str:
    """A Hermes tool call as the model writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def writes(text: str):
    """A model that writes `text`: where the server forced the reply's start (a required or
    named tool call's `<tool_call>` and header), the rest of it."""
    def script(prompt: str) -> str:
        forced = prompt[prompt.rfind(REPLY_START) + len(REPLY_START):]
        return text.removeprefix(forced)
    return script


def agent_script(name: str, arguments: str, answer: str):
    """A model that calls `name` once, then writes `answer` once the tool's result is in
    the prompt."""
    def script(prompt: str) -> str:
        return writes(answer if "<tool_response>" in prompt else call(name, arguments))(prompt)
    return script


class SteeredServer:
    """The app over SteeredEngine on a daemon thread's loop; `script(prompt)` is read at
    each request, so a module's tests share one server and each sets its own."""

    def __init__(self, recipe, grammars, **options) -> None:
        self.script = lambda prompt: ""
        self._started: list = []
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self.engine, client = self._call(start_server(
            recipe, lambda prompt: self.script(prompt), grammars, self._started, **options))
        self.url = str(client.make_url("")).rstrip("/")

    @property
    def prompts(self) -> list[str]:
        """The prompt text of every request the engine was sent, oldest first."""
        return [self.engine.recipe.decode(m.prompt_token_ids, skip_special_tokens=False)
                for m in self.engine.added]

    def close(self) -> None:
        for client in self._started:
            self._call(client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

"""The web demo with a reasoning model: the thinking streams into a collapsible block above the
answer (open while it streams, closed once the answer begins), never into the answer."""
from __future__ import annotations

import pytest
from frontend_fakes import FakeEngineClient, FakeRecipe
from web_fakes import ThreadedServer

from duplex.frontend.server import AppState, build_app

pytest.importorskip("playwright.sync_api", reason="playwright missing (pip install playwright)")
pytestmark = pytest.mark.browser

REPLY = "<think>\nLet me think <b>about</b> it.\n</think>\n\nThe answer."


class ThinkingRecipe(FakeRecipe):
    """The fake recipe with a Qwen3-like template, so the server detects the qwen3 parser."""
    template = ("{% if enable_thinking is defined and enable_thinking is false %}"
                "<think>\n\n</think>\n\n{% endif %}")


class ThinkingServer(ThreadedServer):
    async def _start(self) -> None:
        from aiohttp import web
        state = AppState(self.engine, ThinkingRecipe(), self.options)
        assert state.reasoning.name == "qwen3"
        self.runner = web.AppRunner(build_app(state), handler_cancellation=True,
                                    shutdown_timeout=2.0, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()


@pytest.fixture(scope="module")
def server():
    server = ThinkingServer(FakeEngineClient(reply=REPLY, step_s=0.03, max_model_len=4096))
    server.start()
    yield server
    server.close()


def test_thinking_streams_in_a_collapsible_block(make_ui, server):
    ui = make_ui(server.url).open()
    ui.send("Why?")
    ui.page.wait_for_function(  # the block is open and filling while the model thinks
        "() => { const a = document.querySelector('article.msg.assistant');"
        " const r = a && a.querySelector('details.reasoning');"
        " return a.dataset.state === 'streaming' && r && r.open"
        " && r.querySelector('.reasoning-text').textContent.length > 3; }")
    ui.wait_answer_state("done")
    block = ui.answer().locator("details.reasoning")
    assert block.evaluate("d => d.open") is False
    assert block.locator("summary").text_content() == "Thought"
    assert block.locator(".reasoning-text").text_content() == "Let me think <b>about</b> it."
    assert block.locator("b").count() == 0  # plain text, never HTML
    assert ui.answer().locator(".answer-body").inner_text().strip() == "The answer."
    assert ui.page_errors == []

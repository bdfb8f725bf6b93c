"""The demo against a server started with an API key, in a real headless Chromium: it asks for
the key, says so when the key is wrong, connects with the right one, and the key never appears
in a URL (the WebSocket carries it as a subprotocol, fetches as a header)."""
from __future__ import annotations

import pytest
from web_fakes import ScriptedEngine, ThreadedServer

from duplex.frontend.server import ServerOptions

expect = pytest.importorskip("playwright.sync_api",
                             reason="playwright missing (pip install playwright)").expect

pytestmark = pytest.mark.browser
KEY = "demo-key-7"


@pytest.fixture(scope="module")
def server():
    server = ThreadedServer(ScriptedEngine(step_s=0.01), ServerOptions(api_keys=(KEY,)))
    server.start()
    yield server
    server.close()


def open_page(make_ui, server, key: str | None = None):
    script = f"localStorage.setItem('duplex.apiKey.v1', {key!r});" if key else ""
    ui = make_ui(server.url, init_script=script)
    urls: list[str] = []
    ui.page.on("request", lambda request: urls.append(request.url))
    ui.page.on("websocket", lambda socket: urls.append(socket.url))
    ui.page.goto(server.url)
    return ui, urls


def test_page_asks_for_the_key_then_says_a_wrong_one_is_wrong(make_ui, server):
    ui, _ = open_page(make_ui, server)
    dialog = ui.page.locator("#key-dialog")
    expect(dialog).to_have_attribute("data-reason", "needed")
    expect(dialog).to_be_visible()
    expect(ui.page.locator("#conn")).to_have_attribute("data-state", "locked")
    ui.page.fill("#key-dialog input[name=key]", "not-the-key")
    ui.page.press("#key-dialog input[name=key]", "Enter")
    expect(dialog).to_have_attribute("data-reason", "wrong")
    expect(dialog.locator("[data-field=key-message]")).to_contain_text("wrong key")
    ui.screenshot("auth-wrong-key.png")
    assert ui.sent == []  # no WebSocket frame went out without a valid key
    assert ui.page_errors == []


def test_right_key_connects_and_never_travels_in_a_url(make_ui, server):
    ui, urls = open_page(make_ui, server)
    ui.page.fill("#key-dialog input[name=key]", KEY)
    ui.page.press("#key-dialog input[name=key]", "Enter")
    ui.page.wait_for_selector("#conn[data-state=open]")
    ui.send("What is Duplex?")
    ui.wait_answer_state("done")
    assert ui.page.evaluate("localStorage.getItem('duplex.apiKey.v1')") == KEY
    expect(ui.page.locator("#server-panel [data-field=source]")).to_have_text("from /v1/status")
    assert any(u.endswith("/v1/ws") for u in urls)
    assert not [u for u in urls if "demo-key" in u or "api_key" in u]
    ui.screenshot("auth-connected.png")

    ui2, _ = open_page(make_ui, server, key=KEY)  # a reload: the stored key is used at once
    ui2.page.wait_for_selector("#conn[data-state=open]")
    expect(ui2.page.locator("#key-dialog")).not_to_be_visible()
    # Settings -> API key…: a new key replaces the old; a wrong one locks the page again
    ui2.page.click("#open-settings")
    ui2.page.click("#change-key")
    ui2.page.fill("#key-dialog input[name=key]", "typo-key")
    ui2.page.press("#key-dialog input[name=key]", "Enter")
    expect(ui2.page.locator("#key-dialog")).to_have_attribute("data-reason", "wrong")
    expect(ui2.page.locator("#conn")).to_have_attribute("data-state", "locked")
    assert ui.page_errors == [] and ui2.page_errors == []


def test_a_stored_key_that_went_wrong_reopens_the_dialog(make_ui, server):
    ui, _ = open_page(make_ui, server, key="stale-key")
    expect(ui.page.locator("#key-dialog")).to_have_attribute("data-reason", "wrong")
    assert ui.sent == []

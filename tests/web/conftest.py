"""Fixtures for the browser tests: Debian's headless Chromium driven by Playwright, and a page
object that knows the demo's DOM. Skipped, with the reason, when either is missing."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "frontend"))  # frontend_fakes

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
TIMEOUT_MS = 20_000


def pytest_collection_modifyitems(config, items):
    reason = _missing_browser()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


def _missing_browser() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} missing (apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright missing (pip install playwright; never `playwright install`)"
    return None


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def make_ui(browser, tmp_path):
    contexts = []

    def make(url: str, width: int = 1280, height: int = 800, init_script: str = "") -> "Ui":
        context = browser.new_context(viewport={"width": width, "height": height},
                                      color_scheme="light")
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        if init_script:
            page.add_init_script(init_script)
        return Ui(page, url, tmp_path)

    yield make
    for context in contexts:
        context.close()


class Ui:
    """The demo page in one browser tab, with the WebSocket frames it sent and received."""

    def __init__(self, page, url: str, out_dir: Path) -> None:
        self.page = page
        self.url = url
        self.out_dir = out_dir
        self.sent: list[dict] = []
        self.received: list[dict] = []
        self.page_errors: list[str] = []
        self.dialogs: list[str] = []
        page.on("websocket", self._watch_socket)
        page.on("pageerror", lambda error: self.page_errors.append(str(error)))
        page.on("dialog", self._on_dialog)

    def open(self) -> "Ui":
        self.page.goto(self.url)
        self.page.wait_for_selector("#conn[data-state=open]")
        return self

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def answer(self, n: int = -1):
        """The n-th assistant answer (-1: the last) as a locator."""
        return self.page.locator("article.msg.assistant").nth(n)

    def wait_answer_state(self, state: str, timeout_ms: int = TIMEOUT_MS) -> None:
        from playwright.sync_api import expect
        expect(self.answer()).to_have_attribute("data-state", state, timeout=timeout_ms)

    def stat(self, name: str, n: int = -1) -> str:
        return self.answer(n).locator(f'[data-stat="{name}"] dd').inner_text()

    def frames(self, kind: str) -> list[dict]:
        return [f for f in self.received if f.get("type") == kind]

    def screenshot(self, name: str) -> Path:
        path = self.out_dir / name
        self.page.screenshot(path=str(path))
        return path

    def _watch_socket(self, socket) -> None:
        socket.on("framesent", lambda payload: self.sent.append(_json(payload)))
        socket.on("framereceived", lambda payload: self.received.append(_json(payload)))

    def _on_dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()


def _json(payload) -> dict:
    return json.loads(payload if isinstance(payload, str) else payload.decode())

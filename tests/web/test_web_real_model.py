"""The web demo against `duplex serve` with the real default model: one question, streamed
tokens, one `done` frame with usage, and the page's statistics filled in from it."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from web_fakes import free_port

from duplex.engine.config import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE

expect = pytest.importorskip("playwright.sync_api",
                             reason="playwright missing (pip install playwright)").expect

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="default model not installed")]

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 240
ANSWER_TIMEOUT_MS = 180_000
MAX_TOKENS = 12  # a busy 2-core box decodes slowly; a greeting fits
SETTINGS = json.dumps({"maxTokens": MAX_TOKENS, "temperature": 0.0})


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "duplex.frontend.cli", "serve", "--port", str(port),
             "--num-kv-blocks", "256", "--max-model-len", "2048"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=log,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_healthy(url, process, log_path)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _wait_healthy(url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server exited:\n{log_path.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not healthy in {STARTUP_S} s:\n{log_path.read_text()[-3000:]}")


def test_say_hello_to_the_default_model(make_ui, real_server):
    ui = make_ui(real_server,
                 init_script=f"localStorage.setItem('duplex.settings.v1', '{SETTINGS}')")
    ui.open()
    ui.send("Say hello")
    ui.wait_answer_state("done", timeout_ms=ANSWER_TIMEOUT_MS)

    deltas, (done,) = ui.frames("delta"), ui.frames("done")
    (chat,) = [f for f in ui.sent if f["type"] == "chat"]
    assert chat["messages"] == [{"role": "user", "content": "Say hello"}]
    assert chat["max_tokens"] == MAX_TOKENS
    assert deltas and "".join(d["text"] for d in deltas).strip()
    usage = done["usage"]
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS
    assert usage["prompt_tokens"] > 0 and usage["cached_tokens"] >= 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert done["finish_reason"] in ("stop", "length") and done["timings"]["ttft_s"] > 0

    shown = ui.answer().locator(".answer-body").inner_text()
    assert shown.strip() == "".join(d["text"] for d in deltas).strip()
    assert ui.stat("tokens") == str(usage["completion_tokens"])
    assert ui.stat("finish") == done["finish_reason"]
    assert ui.stat("cache").startswith(f"{usage['cached_tokens']} / {usage['prompt_tokens']}")
    expect(ui.page.locator("#model-name")).to_have_text(DEFAULT_MODEL_NAME)
    expect(ui.page.locator("#server-panel [data-field=layout]")).to_have_text("unified × 1")
    ui.screenshot("real-model.png")
    assert ui.page_errors == []

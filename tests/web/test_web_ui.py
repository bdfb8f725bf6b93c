"""The web demo in a real headless Chromium against the real aiohttp app over a scripted fake
engine (tests/web/web_fakes.py): streaming and stats, stop, inert HTML, error frames, the
reconnect banner, the /metrics fallback, keyboard and settings, a narrow screen; rendered
markdown (tables, highlighted code, math, neutralised script), saved conversations (reload,
regenerate, edit, the list) and every sampling field."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import msgspec
import pytest
from web_fakes import HTML_REPLY, MARKDOWN_REPLY, ScriptedEngine, ThreadedServer

from duplex.frontend.protocol import SamplingFields

expect = pytest.importorskip("playwright.sync_api",
                             reason="playwright missing (pip install playwright)").expect

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
README_SCREENSHOT = REPO / "docs" / "screenshots" / "web-demo.png"
# Rewrite the README's screenshot (a tracked file) only when asked, so test runs leave git clean.
PAGE_SCRIPTS = ["/vendor/markdown-it/markdown-it.min.js", "/vendor/markdown-it-texmath/texmath.js",
                "/vendor/katex/katex.min.js", "/vendor/highlight.js/highlight.min.js",
                "/vendor/dompurify/purify.min.js", "/app.js"]
UPDATE_SCREENSHOT = os.environ.get("DUPLEX_UPDATE_SCREENSHOTS") == "1"


@pytest.fixture(scope="module")
def server():
    server = ThreadedServer(ScriptedEngine(step_s=0.02))
    server.start()
    yield server
    server.close()


@pytest.fixture
def ui(make_ui, server):
    ui = make_ui(server.url).open()
    yield ui
    assert ui.page_errors == [], "uncaught errors in the page"
    assert ui.dialogs == [], "the page opened a dialog (model output executed?)"


@pytest.fixture
def unlimited_ui(make_ui, server):
    """The page with no token limit set, so a long answer runs on for the rest of the context
    (seconds): at the default 512 tokens a fast box streamed a whole long answer before a
    test's stop click landed."""
    ui = make_ui(server.url, init_script="localStorage.setItem('duplex.settings.v1',"
                                         " JSON.stringify({maxTokens: null}))").open()
    yield ui
    assert ui.page_errors == [], "uncaught errors in the page"
    assert "max_tokens" not in ui.sent[0]


def test_answer_streams_and_stats_fill_in(ui):
    ui.send("What is Duplex?")
    ui.page.wait_for_function(  # text visible while the answer is still streaming
        "() => { const a = document.querySelector('article.msg.assistant');"
        " return a.dataset.state === 'streaming'"
        " && a.querySelector('.answer-body').textContent.length > 3; }")
    ui.wait_answer_state("done")

    deltas, (done,) = ui.frames("delta"), ui.frames("done")
    assert len(deltas) > 10 and done["usage"]["completion_tokens"] == len(MARKDOWN_REPLY.encode())
    body = ui.answer().locator(".answer-body")
    assert body.locator("strong").all_inner_texts() == ["prefill", "decode"]
    assert body.locator("ul > li").count() == 2
    assert body.locator("figure.code pre code").inner_text() == 'print("hello from duplex")'
    assert body.locator("p code").inner_text() == "cache hit"

    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", ui.stat("ttft"))
    assert ui.stat("speed").endswith("tok/s")
    assert ui.stat("tokens") == str(done["usage"]["completion_tokens"])
    usage = done["usage"]
    assert ui.stat("cache").startswith(f"{usage['cached_tokens']} / {usage['prompt_tokens']} (")
    assert ui.stat("tiers") == " · ".join(f"{tier} {n}" for tier, n in
                                         usage["cached_tokens_by_tier"].items())
    accepted = sum(d["draft_accepted"] for d in deltas)
    proposed = sum(d["draft_proposed"] for d in deltas)
    assert ui.stat("drafts").startswith(f"{accepted} / {proposed} (")
    assert ui.stat("finish") == "stop"
    drafted = "".join(body.locator(".drafted").all_text_contents())
    assert 0 < len(drafted) < len(MARKDOWN_REPLY)  # accepted drafts marked, target tokens not

    panel = ui.page.locator("#server-panel")
    expect(panel.locator("[data-field=state]")).to_have_text("ready")
    expect(panel.locator("[data-field=hit-rate]")).to_have_text("25%")  # FakeEngine stats
    expect(panel.locator("[data-field=layout]")).to_have_text("unified × 1")
    expect(panel.locator("[data-field=speculation]")).to_contain_text("ngram")
    expect(panel.locator("[data-field=batch-invariant]")).to_have_text("off")
    expect(panel.locator("[data-field=source]")).to_have_text("from /v1/status")
    expect(ui.page.locator("#model-name")).to_have_text("fake-model")
    ui.screenshot("answer.png")


def test_stop_cancels_a_long_answer(unlimited_ui, server):
    ui = unlimited_ui
    ui.send("Tell me a long story")
    ui.page.wait_for_function("document.querySelector('article.msg.assistant .answer-body')"
                              ".textContent.length > 40")
    ui.page.click("#stop")
    ui.wait_answer_state("stopped")

    cancels = [f for f in ui.sent if f["type"] == "cancel"]
    assert cancels == [{"type": "cancel", "id": ui.sent[0]["id"]}]
    assert ui.frames("error")[-1]["code"] == "cancelled" and not ui.frames("done")
    assert ui.stat("finish") == "stopped"
    shown = ui.answer().locator(".answer-body").inner_text()
    time.sleep(0.3)
    assert ui.answer().locator(".answer-body").inner_text() == shown  # nothing more arrives
    expect(ui.page.locator("#send")).to_be_visible()
    expect(ui.page.locator("#stop")).to_be_hidden()
    deadline = time.monotonic() + 5
    while not server.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.aborted, "the engine request was not aborted"


def test_html_in_answers_and_questions_is_shown_as_text(ui):
    question = "<img src=x onerror=alert(2)><i>html</i> please"
    ui.send(question)
    ui.wait_answer_state("done")
    conversation = ui.page.locator("#conversation")
    assert ui.answer().locator(".answer-body").inner_text() == HTML_REPLY
    assert ui.page.locator("article.msg.user .bubble").inner_text() == question
    assert conversation.locator("script, b, img, i").count() == 0
    scripts = ui.page.evaluate("[...document.scripts].map(s => new URL(s.src).pathname)")
    assert scripts == PAGE_SCRIPTS  # only the page's own module and the vendored libraries
    assert ui.page.evaluate("typeof window.alert") == "function"  # and nothing called it


def test_error_frame_is_shown_in_the_conversation(ui):
    ui.send("please fail")
    ui.wait_answer_state("error")
    (error,) = ui.frames("error")
    problem = ui.answer().locator(".problem")
    expect(problem).to_be_visible()
    expect(problem).to_contain_text(error["code"])
    expect(problem).to_contain_text("worker died (scripted)")
    assert ui.stat("finish") == "error"
    ui.send("and now?")  # the failed turn is not sent again
    ui.wait_answer_state("done")
    contents = [m["content"] for m in ui.sent[-1]["messages"]]
    assert contents == ["and now?"]


def test_banner_and_reconnect_when_the_server_goes_away(ui, server):
    server.stop()
    banner = ui.page.locator("#banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("Can't reach the server")
    expect(ui.page.locator("#conn")).not_to_have_attribute("data-state", "open")
    expect(ui.page.locator("#send")).to_be_disabled()
    expect(ui.page.locator("#server-panel [data-field=state]")).to_have_text("unreachable")
    ui.screenshot("offline.png")

    server.start()
    ui.page.evaluate("document.getElementById('retry-now').click()")  # skip the backoff wait
    expect(ui.page.locator("#conn")).to_have_attribute("data-state", "open", timeout=15_000)
    expect(banner).to_be_hidden()
    ui.send("back again?")
    ui.wait_answer_state("done")


def test_status_panel_falls_back_to_metrics(make_ui, server):
    ui = make_ui(server.url)
    ui.page.route("**/v1/status", lambda route: route.fulfill(status=404, body="gone"))
    ui.open()
    panel = ui.page.locator("#server-panel")
    expect(panel.locator("[data-field=source]")).to_have_text("from /metrics")
    expect(panel.locator("[data-field=state]")).to_have_text("ready")
    expect(panel.locator("[data-field=layout]")).to_have_text("unified × 1")
    expect(panel.locator("[data-field=running]")).to_have_text("0")
    assert ui.page_errors == []


def test_keyboard_and_settings_shape_the_request(ui):
    ui.page.click("#open-settings")
    dialog = ui.page.locator("#settings")
    expect(dialog).to_be_visible()
    dialog.locator("textarea[name=system]").fill("Answer briefly.")
    dialog.locator("input[name=maxTokens]").fill("5")
    dialog.locator("input[name=temperature]").fill("0.3")
    expect(dialog.locator("#speculation")).to_be_enabled()  # the server takes a per-request switch
    expect(dialog.locator("#speculation-note")).to_contain_text("ngram")
    dialog.locator("#speculation").uncheck()
    ui.page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()

    prompt = ui.page.locator("#prompt")
    prompt.focus()
    ui.page.keyboard.type("first line")
    ui.page.keyboard.press("Shift+Enter")
    ui.page.keyboard.type("second line")
    assert not ui.sent  # Shift+Enter is a newline, not a send
    ui.page.keyboard.press("Enter")
    ui.wait_answer_state("done")

    (chat,) = [f for f in ui.sent if f["type"] == "chat"]
    assert chat["messages"] == [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "first line\nsecond line"}]
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (5, 0.3, 0.9)
    assert chat["speculate"] is False
    assert ui.stat("finish") == "length" and ui.stat("tokens") == "5"
    assert ui.page.locator("article.msg.user .bubble").inner_text() == "first line\nsecond line"

    ui.page.click("#new-chat")
    expect(ui.page.locator("article.msg")).to_have_count(0)
    expect(ui.page.locator("#empty-state")).to_be_visible()


def test_narrow_screen(make_ui, server):
    ui = make_ui(server.url, width=390, height=844).open()
    assert ui.page.evaluate("document.documentElement.scrollWidth") <= 390
    panel = ui.page.locator("#server-panel")
    expect(panel).not_to_be_in_viewport()
    ui.send("Hello from a phone")
    ui.wait_answer_state("done")
    assert ui.page.evaluate("document.documentElement.scrollWidth") <= 390
    expect(ui.page.locator("#prompt")).to_be_in_viewport()
    ui.screenshot("narrow.png")

    ui.page.click("#toggle-panel")
    expect(panel).to_be_in_viewport(ratio=0.9)
    expect(panel.locator("[data-field=state]")).to_have_text("ready")
    ui.screenshot("narrow-panel.png")
    ui.page.keyboard.press("Escape")
    expect(panel).not_to_be_in_viewport()
    assert ui.page_errors == []


def test_screenshot_for_the_readme(make_ui, server):
    ui = make_ui(server.url, width=1280, height=800).open()
    ui.send("What is Duplex?")
    ui.wait_answer_state("done")
    ui.send("Something rich: a table, code and math")
    ui.wait_answer_state("done")
    ui.page.wait_for_timeout(1500)  # a few status polls for the chart
    path = ui.screenshot("web-demo.png")
    if UPDATE_SCREENSHOT or not README_SCREENSHOT.exists():  # timings differ run to run
        README_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        README_SCREENSHOT.write_bytes(path.read_bytes())
    assert ui.page_errors == []


MARKDOWN_CASES = {
    "nested": "1. one\n2. two\n   - inner *em*\n3. three",
    "fence": "```js\nlet a = '<b>';\n",  # unclosed while streaming: still a code block
    "links": "[ok](https://example.com/x) [bad](javascript:alert(1)) <a href=x>y</a>",
    "blocks": "## Title\n> quoted **bold**\n\n---\nend",
}


def test_markdown_renderer_builds_only_safe_nodes(ui):
    html = ui.page.evaluate("""async (cases) => {
        const { renderMarkdown } = await import('/markdown.js');
        const out = {};
        for (const [name, text] of Object.entries(cases)) {
            const box = document.createElement('div');
            box.append(renderMarkdown(text, [{start: 0, end: 4, title: 't'}]));
            out[name] = box.innerHTML;
        }
        return out;
    }""", MARKDOWN_CASES)
    # marks: source [0, 4) is "1. o" -> only the "o" of "one" is text; "## T" -> the "T"
    assert html["nested"] == (
        '<ol>\n<li><span class="drafted" title="t">o</span>ne</li>\n<li>two\n<ul>\n'
        '<li>inner <em>em</em></li>\n</ul>\n</li>\n<li>three</li>\n</ol>\n')
    assert '<pre><code class="hljs language-js"><span class="hljs-keyword">let</span> a = ' \
        '<span class="hljs-string">\'&lt;b&gt;\'</span>;</code></pre>' in html["fence"]
    assert html["links"].count("<a ") == 1
    assert 'href="https://example.com/x"' in html["links"] and "&lt;a href=x&gt;y&lt;/a&gt;" \
        in html["links"] and "javascript" in html["links"]  # as text, not as an href
    assert 'href="javascript' not in html["links"]
    assert html["blocks"].startswith('<h2><span class="drafted" title="t">T</span>itle</h2>')
    assert "<blockquote>\n<p>quoted <strong>bold</strong></p>\n</blockquote>\n<hr>\n" \
        "<p>end</p>" in html["blocks"]


def test_table_code_math_rendered_and_script_neutralised(ui):
    ui.send("something rich please")
    ui.wait_answer_state("done")
    body = ui.answer().locator(".answer-body")
    assert body.locator("table thead th").all_inner_texts() == ["engine", "step"]
    assert body.locator("table tbody tr").count() == 2
    assert body.locator("table tbody tr").nth(0).locator("td").all_inner_texts() == \
        ["duplex", "10 ms"]
    code = body.locator("figure.code pre code.language-python")
    assert code.inner_text() == 'def hello():\n    return "<b>hi</b>"'
    assert code.locator(".hljs-keyword").all_inner_texts()[:2] == ["def", "return"]
    assert code.locator(".hljs-string").inner_text() == '"<b>hi</b>"'
    assert body.locator("figure.code figcaption .lang").inner_text() == "python"
    assert body.locator(".katex").count() == 2  # inline + block
    assert body.locator(".katex-display").count() == 1
    inline = body.locator(".katex").nth(0)
    assert inline.locator(".katex-html").count() == 1 and "π" in inline.text_content()
    assert "∫" in body.locator(".katex-display").text_content()
    # model-written HTML and javascript: links stay text; only the https link is a link
    assert body.locator("script, img, b").count() == 0
    assert body.locator("a").evaluate_all("as => as.map(a => a.href)") == ["https://example.com/"]
    assert body.locator("a").get_attribute("rel") == "noopener noreferrer nofollow"
    assert "<script>alert(3)</script>" in body.inner_text()
    assert ui.page.evaluate("typeof window.alert") == "function"
    # the copy button copies the code as text
    ui.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    body.locator("figure.code [data-action=copy]").click()
    expect(body.locator("figure.code [data-action=copy]")).to_have_text("Copied")
    assert ui.page.evaluate("navigator.clipboard.readText()") == \
        'def hello():\n    return "<b>hi</b>"'
    ui.screenshot("rich.png")


def test_streaming_renders_finished_blocks_once(unlimited_ui):
    """Finished blocks are not rebuilt per frame: a node of the first paragraph survives
    the rest of a long stream (the whole answer is rendered once more at the end)."""
    ui = unlimited_ui
    ui.send("a long one")
    ui.page.wait_for_function("() => document.querySelector("
                              "'article.msg.assistant:last-of-type .md-done p')")
    ui.page.evaluate("window.__first = document.querySelector("
                     "'article.msg.assistant:last-of-type .md-done p')")
    ui.page.wait_for_function("() => document.querySelector('article.msg.assistant:last-of-type"
                              " .answer-body').textContent.length > 400")
    assert ui.page.evaluate("window.__first.isConnected") is True
    ui.page.click("#stop")
    ui.wait_answer_state("stopped")


def test_conversation_survives_reload_regenerate_edit_and_the_list(make_ui, server):
    ui = make_ui(server.url).open()
    ui.send("What is Duplex?")
    ui.wait_answer_state("done")
    ui.send("And a second question")
    ui.wait_answer_state("done")
    first_answer = ui.answer(0).locator(".answer-body").inner_text()

    ui.page.reload()
    ui.page.wait_for_selector("#conn[data-state=open]")
    expect(ui.page.locator("article.msg")).to_have_count(4)
    assert ui.page.locator("article.msg.user .bubble").all_inner_texts() == \
        ["What is Duplex?", "And a second question"]
    assert ui.answer(0).locator(".answer-body").inner_text() == first_answer
    assert ui.answer(0).locator(".answer-body strong").all_inner_texts() == ["prefill", "decode"]
    assert ui.stat("finish", 0) == "stop"  # the server's figures came back with it
    ui.screenshot("reloaded.png")

    ui.answer(-1).locator("[data-msg-action=regenerate]").click()
    ui.wait_answer_state("done")
    expect(ui.page.locator("article.msg")).to_have_count(4)
    roles = [(m["role"], m["content"][:12]) for m in ui.sent[-1]["messages"]]
    assert roles == [("user", "What is Dupl"), ("assistant", first_answer[:12]),
                     ("user", "And a second")]

    ui.page.locator("article.msg.user").nth(0).locator("[data-msg-action=edit]").click()
    ui.page.fill("article.msg.user .edit-box", "Edited question")
    ui.page.click("article.msg.user .edit button[type=submit]")
    ui.wait_answer_state("done")
    expect(ui.page.locator("article.msg")).to_have_count(2)
    assert ui.sent[-1]["messages"] == [{"role": "user", "content": "Edited question"}]

    ui.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    ui.answer().locator("[data-msg-action=copy-message]").click()
    assert ui.page.evaluate("navigator.clipboard.readText()") == MARKDOWN_REPLY  # the source

    ui.page.click("#new-chat")
    ui.send("html in a second chat")
    ui.wait_answer_state("done")
    ui.page.click("#open-history")
    rows = ui.page.locator("#history li[data-id]")
    expect(rows).to_have_count(2)
    assert rows.locator(".title").all_inner_texts() == ["html in a second chat", "What is Duplex?"]
    rows.nth(1).locator("[data-action=rename]").click()
    ui.page.fill("#history input.rename", "Renamed chat")
    ui.page.press("#history input.rename", "Enter")
    expect(rows.nth(1).locator(".title")).to_have_text("Renamed chat")
    with ui.page.expect_download() as download:
        ui.page.click("#history [data-action=export-all]")
    exported = json.loads(Path(download.value.path()).read_text())
    assert [c["title"] for c in exported["conversations"]] == ["html in a second chat",
                                                               "Renamed chat"]
    assert exported["conversations"][1]["messages"][0] == {"role": "user",
                                                           "content": "Edited question"}
    ui.screenshot("history.png")
    rows.nth(1).locator(".title").click()  # open the renamed one
    expect(ui.page.locator("article.msg.user .bubble")).to_have_text(["Edited question"])
    ui.page.click("#open-history")
    rows.nth(0).locator("[data-action=delete]").click()
    expect(rows).to_have_count(1)
    assert ui.page.evaluate("JSON.parse(localStorage.getItem('duplex.conversations.v1'))"
                            ".map(c => c.title)") == ["Renamed chat"]
    assert ui.page_errors == []


def test_every_sampling_field_is_settable_and_shown(ui, server):
    max_model_len = server.engine.ready_info.max_model_len
    expect(ui.page.locator("#model-context")).to_have_text(f"{max_model_len:,} ctx")
    ui.page.click("#open-settings")
    dialog = ui.page.locator("#settings")
    dialog.locator("summary").click()
    form = dialog.locator("[data-field=advanced]")
    form.locator("input[name=topK]").fill("40")
    form.locator("input[name=seed]").fill("7")
    form.locator("textarea[name=stop]").fill("END\nSTOP")
    form.locator("input[name=ignoreEos]").check()
    form.locator("select[name=retention]").select_option("agent")
    expect(form.locator("output[data-shows=topK]")).to_have_text("40")
    expect(form.locator("output[data-shows=stop]")).to_have_text('"END", "STOP"')
    expect(form.locator("output[data-shows=ignoreEos]")).to_have_text("on")
    expect(form.locator("output[data-shows=minP]")).to_have_text("server default")
    names = form.locator("label > span").evaluate_all("ss => ss.map(s => s.firstChild.data)")
    assert set(names) == {"top_k", "min_p", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "seed", "min_tokens", "stop", "cache_salt",
                          "retention", "ignore_eos", "include_stop_str_in_output",
                          "skip_special_tokens"}
    # with the main four, every sampling field a WebSocket chat frame takes (a field added to
    # the API fails here until the settings dialog has it)
    api_fields = {f.name for f in msgspec.structs.fields(SamplingFields)}
    assert set(names) | {"temperature", "top_p", "max_tokens", "speculate"} == api_fields
    ui.page.keyboard.press("Escape")
    ui.send("What is Duplex?")
    ui.wait_answer_state("done")
    (chat,) = [f for f in ui.sent if f["type"] == "chat"]
    assert {k: chat[k] for k in ("top_k", "seed", "stop", "ignore_eos", "retention")} == \
        {"top_k": 40, "seed": 7, "stop": ["END", "STOP"], "ignore_eos": True,
         "retention": "agent"}
    assert not {"min_p", "presence_penalty", "skip_special_tokens", "cache_salt"} & set(chat)

"""Perf (not in `make test`; run: pytest -m perf tests/web/test_web_render_perf.py -s): the cost
of one streaming render frame of a long answer in headless Chromium, StreamRenderer (finished
blocks once, the tail again) against re-rendering the whole text, at several answer lengths."""
from __future__ import annotations

import statistics

import pytest
from web_fakes import ScriptedEngine, ThreadedServer

pytestmark = [pytest.mark.perf, pytest.mark.browser]

BLOCK = ("Paragraph with **bold**, `code` and a [link](https://example.com/) that goes on "
         "for a while so the text is realistic, and math $a^2+b^2=c^2$.\n\n"
         "| a | b |\n| --- | --- |\n| 1 | 2 |\n\n"
         "```python\ndef f(x):\n    return x * 2\n```\n\n")
MEASURE = """async ([text, step]) => {
    const { renderMarkdown, StreamRenderer } = await import('/markdown.js');
    const box = document.createElement('div');
    document.body.append(box);
    const stream = new StreamRenderer(box);
    const tail = [], full = [];
    for (let end = step; end <= text.length; end += step) {  // one streamed answer
        const t = performance.now();
        stream.update(text.slice(0, end), []);
        tail.push([end, performance.now() - t]);
    }
    for (let end = step; end <= text.length; end += 4 * step) {  // the old way, per frame
        const t = performance.now();
        box.replaceChildren(renderMarkdown(text.slice(0, end), []));
        full.push([end, performance.now() - t]);
    }
    box.remove();
    return { tail, full };
}"""


def test_streaming_frame_cost_stays_flat(make_ui):
    server = ThreadedServer(ScriptedEngine())
    server.start()
    try:
        ui = make_ui(server.url).open()
        text = BLOCK * 72  # ~16k characters
        result = ui.page.evaluate(MEASURE, [text, 200])
    finally:
        server.close()
    rows = []
    for upto in (2_000, 8_000, 16_000):
        tail = [ms for end, ms in result["tail"] if upto - 3_000 < end <= upto]
        full = [ms for end, ms in result["full"] if upto - 3_000 < end <= upto]
        rows.append((upto, statistics.median(tail), statistics.median(full)))
    print("\nchars  median_ms_stream  median_ms_full_rerender")
    for upto, tail_ms, full_ms in rows:
        print(f"{upto:6d}  {tail_ms:16.2f}  {full_ms:22.2f}")
    last_tail, last_full = rows[-1][1], rows[-1][2]
    assert last_tail * 3 < last_full  # the full re-render grows with the text; the tail does not

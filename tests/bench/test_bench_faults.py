"""Bad servers: every fault ends as a counted failure with a reason, within the time bound."""
from __future__ import annotations

import json
import time

import pytest

from duplex.bench.metrics import summarize
from duplex.bench.runner import LoadConfig, run_load
from duplex.bench.workloads import Conversation, Turn


def conversations(num: int, num_turns: int = 1) -> list[Conversation]:
    turn = Turn(({"role": "user", "content": "hello"},), 8)
    return [Conversation(i, (turn,) * num_turns) for i in range(num)]


def config(url: str, model: str = "ok", **fields) -> LoadConfig:
    return LoadConfig(url=url, model=model, progress=False, **fields)


async def run(url: str, model: str, num: int = 3, **fields):
    result = await run_load(conversations(num), config(url, model, **fields))
    return result, summarize(result.records, result.duration_s, result.num_planned)


@pytest.mark.parametrize("model, status, error", [
    ("http500", "failed", "HTTP 500"),
    ("http400", "failed", "HTTP 400"),
    ("http429", "rejected", "HTTP 429"),
    ("http503", "rejected", "HTTP 503"),
    ("malformed", "failed", "malformed stream"),
    ("truncated", "failed", "stream ended before [DONE]"),
    ("stream-error", "failed", "error in stream"),
])
async def test_bad_answers_are_counted_with_reasons(fake_server, model, status, error):
    result, summary = await run(fake_server.url, model, concurrency=2)
    assert [r.status for r in result.records] == [status] * 3
    assert {r.error for r in result.records} == {error}
    assert summary["completed"] == 0
    if status == "failed":
        assert summary["failed"] == 3 and summary["failure_reasons"] == {error: 3}
    else:
        assert summary["rejected"] == 3 and summary["failed"] == 0


async def test_unreachable_server_fails_fast(closed_port_url):
    start = time.perf_counter()
    result, summary = await run(closed_port_url, "ok", num=4, request_rate=100.0)
    assert time.perf_counter() - start < 5
    assert summary["failed"] == 4
    assert summary["failure_reasons"] == {"connection error": 4}


@pytest.mark.parametrize("model", ["hang", "hang-mid"])
async def test_hanging_server_is_cut_off_at_the_deadline(fake_server, model):
    start = time.perf_counter()
    result, summary = await run(fake_server.url, model, num=5, concurrency=2, max_duration_s=1.0)
    assert time.perf_counter() - start < 3
    assert result.timed_out and result.duration_s == 1.0
    assert summary["cancelled"] == 2 and summary["not_sent"] == 3
    assert all(r.error == "cancelled at deadline" for r in result.records)


async def test_hanging_request_times_out(fake_server):
    result, summary = await run(fake_server.url, "hang", num=1, request_timeout_s=0.3)
    assert not result.timed_out
    assert summary["failure_reasons"] == {"timeout": 1}


async def test_failed_turn_ends_its_conversation(fake_server):
    result = await run_load(conversations(2, num_turns=3), config(fake_server.url, "http500"))
    assert len(result.records) == 2 and result.num_planned == 6
    assert summarize(result.records, result.duration_s, result.num_planned)["not_sent"] == 4


async def test_sse_parsing_handles_crlf_comments_and_multiline_data(fake_server):
    result, summary = await run(fake_server.url, "crlf", num=1)
    (record,) = result.records
    assert record.status == "ok", record.detail
    assert record.text == "reply to-1-messages done"
    assert record.prompt_tokens == 100 and record.cached_tokens == 25


def test_cli_writes_a_report_even_when_the_server_hangs(fake_server, tokenizer, tmp_path,
                                                        capsys):
    from duplex.bench import cli
    start = time.perf_counter()
    rc = cli.main(["serve", "--url", fake_server.url, "--model", "hang", "--num-requests", "3",
                   "--input-len", "8", "--output-len", "4", "--concurrency", "3",
                   "--max-duration", "1", "--skip-machine", "--no-progress", "--no-plots",
                   "--out", str(tmp_path), "--label", "hung"])
    assert time.perf_counter() - start < 20
    assert rc == 1
    result = json.loads((tmp_path / "hung.json").read_text())
    assert result["timed_out"] and result["summary"]["cancelled"] == 3
    assert "| cancelled at deadline | 3 |" in (tmp_path / "hung.md").read_text()
    assert "cancelled at deadline | 3" in capsys.readouterr().out

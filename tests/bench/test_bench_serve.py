"""`duplex bench serve` end to end against the fake OpenAI server, plus pacing and compare."""
from __future__ import annotations

import json

import numpy as np
import pytest
from bench_fakes import (CACHED_TOKENS, DRAFT_ACCEPTED, DRAFT_PROPOSED, PROMPT_TOKENS,
                         reply_words)

from duplex.bench import cli
from duplex.bench.metrics import Slo
from duplex.bench.runner import LoadConfig, arrival_times, run_load
from duplex.bench.serve import run_workload
from duplex.bench.workloads import AGENT_HEADER, Conversation, Turn

SMALL = ["--input-len", "8", "--output-len", "4", "--system-len", "16", "--no-progress"]


def serve(url: str, out, *args: str) -> int:
    return cli.main(["serve", "--url", url, "--out", str(out), *SMALL, *args])


def test_serve_writes_json_markdown_and_plots(fake_server, tokenizer, tmp_path, capsys):
    rc = serve(fake_server.url, tmp_path, "--num-requests", "6", "--concurrency", "2",
               "--gemm-shapes", "4x4x4", "--model-gflop-per-token", "0.27",
               "--model-bytes-per-step", "5.4e8", "--ttft-slo-ms", "10000",
               "--label", "run", "--api-key", "sk-test", "--header", "x-extra: 1")
    assert rc == 0
    result = json.loads((tmp_path / "run.json").read_text())
    summary = result["summary"]
    assert (summary["completed"], summary["failed"], summary["num_planned"]) == (6, 0, 6)
    assert summary["cache_hit_rate"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)
    assert summary["spec_acceptance"] == pytest.approx(DRAFT_ACCEPTED / DRAFT_PROPOSED)
    assert summary["output_tokens"] == 6 * 3 and summary["goodput"] > 0
    assert summary["itl_ms"]["count"] == 6 * 2
    assert len(result["records"]) == 6 and result["mode"] == "concurrency"
    assert result["machine"]["gemm"][0]["m"] == 4 and result["machine"]["bandwidth_gbs"] > 0
    assert 0 < result["utilization"]["compute_fraction"]
    assert "api_key" not in result["load"] and "sk-test" not in json.dumps(result)
    assert (tmp_path / "run_cdf.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert out.startswith("Machine:") and "| completed / planned | 6 / 6 |" in out
    assert (tmp_path / "run.md").read_text() in out
    body, headers = fake_server.bodies[0], fake_server.headers[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True
    assert headers["Authorization"] == "Bearer sk-test" and headers["x-extra"] == "1"


def test_multi_turn_resends_the_growing_history_with_actual_replies(fake_server, tokenizer):
    result = run_workload(fake_server.url, "multi-turn", num_conversations=2, num_turns=3,
                          system_len=16, input_len=8, concurrency=2, model="ok",
                          progress=False)
    assert result["summary"]["completed"] == 6
    by_conversation: dict[str, list[list[dict]]] = {}
    for body in fake_server.bodies:
        by_conversation.setdefault(body["messages"][1]["content"], []).append(body["messages"])
    assert len(by_conversation) == 2
    for history in by_conversation.values():
        assert [len(m) for m in history] == [2, 4, 6]
        for earlier, later in zip(history, history[1:]):
            assert later[:len(earlier)] == earlier
            reply = later[len(earlier)]
            assert reply == {"role": "assistant", "content": " ".join(reply_words(earlier))}


def test_agent_traffic_is_marked(fake_server, tokenizer):
    result = run_workload(fake_server.url, "agent", num_conversations=1, num_turns=2,
                          system_len=16, input_len=8, tool_output_len=8, agent_mark="both",
                          model="ok", progress=False)
    assert result["summary"]["completed"] == 2
    assert all(h[AGENT_HEADER[0]] == AGENT_HEADER[1] for h in fake_server.headers)
    assert all(b["tools"][0]["function"]["name"] for b in fake_server.bodies)
    assert fake_server.bodies[1]["messages"][-1]["content"].startswith("Tool result:")


def test_sweep_writes_one_result_per_rate_and_compare_reads_them(fake_server, tokenizer,
                                                                 tmp_path, capsys):
    rc = serve(fake_server.url, tmp_path, "--num-requests", "4", "--sweep-rates", "50,inf",
               "--burstiness", "0.5", "--skip-machine", "--label", "sw")
    assert rc == 0
    sweep = json.loads((tmp_path / "sw-sweep.json").read_text())
    assert [p["request_rate"] for p in sweep["points"]] == [50.0, float("inf")]
    assert all(p["summary"]["completed"] == 4 for p in sweep["points"])
    assert (tmp_path / "sw-sweep.png").stat().st_size > 1000
    assert json.loads((tmp_path / "sw-r50.json").read_text())["mode"] == "rate"
    capsys.readouterr()
    assert cli.main(["compare", str(tmp_path / "sw-r50.json"), str(tmp_path / "sw-rinf.json"),
                     "--out", str(tmp_path / "cmp.md")]) == 0
    table = capsys.readouterr().out
    assert "| metric | sw-r50 | sw-rinf | sw-rinf / sw-r50 |" in table
    assert "| completed | 4 | 4 | 1.00x |" in table
    assert (tmp_path / "cmp.md").read_text() == table


def test_compare_refuses_files_that_are_not_results(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert cli.main(["compare", str(tmp_path / "x.json")]) == 2
    assert "neither a run result" in capsys.readouterr().err


def test_arrival_times_are_seeded_poisson_or_gamma():
    times = arrival_times(20000, rate=10.0, burstiness=1.0, seed=3)
    assert times[0] == 0.0 and times == arrival_times(20000, 10.0, 1.0, seed=3)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)     # exponential: CV 1
    bursty = np.diff(arrival_times(20000, rate=10.0, burstiness=0.25, seed=3))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # gamma: CV 1/sqrt(k)
    assert arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


async def test_trace_mode_follows_the_arrival_times(fake_server):
    turn = Turn(({"role": "user", "content": "hi"},), 4)
    trace = [Conversation(i, (turn,), arrival_s=0.15 * i) for i in range(3)]
    result = await run_load(trace, LoadConfig(url=fake_server.url, progress=False))
    assert result.mode == "trace"
    assert [round(r.send_s, 1) for r in result.records] == pytest.approx([0.0, 0.15, 0.3],
                                                                          abs=0.06)


async def test_concurrency_caps_requests_in_flight_under_a_rate(fake_server):
    turn = Turn(({"role": "user", "content": "hi"},), 4)
    load = LoadConfig(url=fake_server.url, model="slow", request_rate=float("inf"),
                      concurrency=2, num_requests=4, progress=False)
    result = await run_load([Conversation(i, (turn,)) for i in range(6)], load)
    assert len(result.records) == 4 and result.num_planned == 4
    spans = [(r.send_s, r.send_s + r.end_s) for r in result.records]
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most == 2


def test_bad_flags_exit_2(tokenizer, tmp_path, capsys):
    assert cli.main(["serve", "--header", "no-colon", "--skip-machine"]) == 2
    assert cli.main(["serve", "--sweep-rates", "1,-2", "--skip-machine"]) == 2
    assert "--sweep-rates" in capsys.readouterr().err
    assert cli.main(["serve", "--workload", "mooncake", "--trace", str(tmp_path / "none"),
                     "--skip-machine"]) == 2
    assert "No such file" in capsys.readouterr().err


def test_slo_passes_through_the_api(fake_server, tokenizer):
    result = run_workload(fake_server.url, "random", num_requests=2, input_len=8, output_len=4,
                          slo=Slo(ttft_ms=0.001), progress=False)
    assert result["summary"]["goodput"] == 0.0 and result["summary"]["completed"] == 2

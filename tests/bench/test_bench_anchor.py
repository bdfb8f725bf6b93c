"""`duplex bench anchor` without llama.cpp: llama-bench output, the table and its ratios,
arguments, the workloads behind each row, server start/stop, and the side-by-side loop
against two fake OpenAI servers."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
from bench_fakes import FakeOpenAI

from duplex.bench import anchor
from duplex.bench.offline import isolated_gemm_seconds, step_gemms, step_weights
from duplex.bench.server_proc import free_port

# ----- llama-bench -o json -------------------------------------------------------------------

# The shape of `llama-bench -o json` (tools/llama-bench/llama-bench.cpp, json_printer): one
# object per test with every field of test::get_fields(), then samples_ns and samples_ts.
_FIELDS = {
    "build_commit": "abc1234", "build_number": 1, "cpu_info": "Test CPU", "gpu_info": "",
    "backends": "CPU", "model_filename": "m.gguf", "model_type": "llama ?B Q4_1",
    "model_size": 94000000, "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512,
    "n_threads": 2, "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16",
    "type_v": "f16", "n_gpu_layers": 99, "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0,
    "no_kv_offload": False, "flash_attn": -1, "devices": "auto", "tensor_split": "0.00",
    "tensor_buft_overrides": "none", "load_mode": "mmap", "lazy_mode": "none",
    "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True,
    "fit_target": 0, "fit_min_ctx": 0}


def _test(n_prompt, n_gen, samples_ts, n_depth=0):
    mean = sum(samples_ts) / len(samples_ts) if samples_ts else 0.0
    return {**_FIELDS, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth,
            "test_time": "2026-01-01T00:00:00Z", "avg_ns": 1, "stddev_ns": 0,
            "avg_ts": mean, "stddev_ts": 0.0, "samples_ns": [1] * len(samples_ts),
            "samples_ts": samples_ts}


def test_parse_llama_bench_takes_the_median_sample_of_each_test():
    tests = [_test(512, 0, [900.0, 1000.0, 1300.0]), _test(0, 128, [40.0, 50.0, 51.0])]
    text = json.dumps(tests, indent=2)
    rates = anchor.parse_llama_bench(text)
    assert rates == {"pp512": 1000.0, "tg128": 50.0, "raw": tests}


def test_parse_llama_bench_falls_back_to_the_mean_and_names_mixed_tests():
    mixed = _test(512, 128, []) | {"avg_ts": 77.5}
    deep = _test(0, 64, [10.0], n_depth=1024)
    rates = anchor.parse_llama_bench("log line before\n" + json.dumps([mixed, deep]))
    assert {k: v for k, v in rates.items() if k != "raw"} == \
        {"pp512+tg128": 77.5, "tg64 @ d1024": 10.0}


# ----- the table -----------------------------------------------------------------------------

def _summary(out, tpot=None, ttft50=None, ttft99=None, hit=None, completed=2, reasons=None,
             rss=None):
    return {"output_throughput": out, "tpot_ms": {"p50": tpot}, "rss_mb": rss,
            "ttft_ms": {"p50": ttft50, "p99": ttft99}, "cache_hit_rate": hit,
            "num_planned": 2, "completed": completed, "failure_reasons": reasons or {}}


def _runs(workload, server, summaries):
    return [{"workload": workload, "server": server, "repeat": r, "summary": s}
            for r, s in enumerate(summaries)]


def _result():
    runs = (_runs("single", "llama", [_summary(10.0, 5.0, rss=1200.0),
                                      _summary(12.0, 6.0, rss=1250.0),
                                      _summary(11.0, 7.0, rss=1300.0)])
            + _runs("single", "duplex", [_summary(20.0, 3.0, rss=1500.0),
                                         _summary(22.0, 3.0, rss=1500.0),
                                         _summary(21.0, 4.0, rss=1600.0)])
            + _runs("multiturn", "llama", [_summary(30.0, ttft99=400.0),
                                           _summary(40.0, ttft99=500.0)])
            + _runs("multiturn", "duplex", [_summary(45.0, ttft99=200.0, hit=0.5),
                                            _summary(35.0, ttft99=300.0, hit=0.75)]))
    bench = {"tests": ["pp512", "tg128"], "llama": {"pp512": 1000.0, "tg128": 50.0},
             "duplex": {"pp512": 500.0, "tg128": 60.0}}
    return {"workloads": ["single", "multiturn", "bench"], "runs": runs, "bench": bench,
            "repeats": 3, "model": "/models/SmolLM2.gguf", "threads": 2, "llama_repack": True}


def test_markdown_reports_medians_and_duplex_over_llama_ratios():
    assert anchor.markdown(_result()) == textwrap.dedent("""\
        | workload | llama-server | Duplex | ratio |
        |---|---|---|---|
        | one stream, ~60-word prompts, 128 tokens out | 11.0 out tok/s, TPOT 6.0 ms, \
RSS 1250 MB | 21.0 out tok/s, TPOT 3.0 ms, RSS 1500 MB | out tok/s 1.91x, TPOT 0.50x, \
RSS 1.20x |
        | 8 conversations x 4 turns, 64 out, concurrency 8 | 35.0 out tok/s, hit rate n/a, \
TTFT p99 450 ms | 40.0 out tok/s, hit rate 62%, TTFT p99 250 ms | out tok/s 1.14x, \
hit rate n/a, TTFT p99 0.56x |
        | llama-bench pp512 / tg128 vs the offline engine, same prompt sizes | \
pp512 1000.0 tok/s, tg128 50.0 tok/s | pp512 500.0 tok/s, tg128 60.0 tok/s | \
pp512 0.50x, tg128 1.20x |

        ratio = Duplex / llama-server (latencies: above 1 is slower); medians of 3 runs; \
streaming chat, temperature 0, ignore_eos; SmolLM2.gguf, 2 threads.
        """)


def test_the_footnote_says_when_llama_cpp_ran_without_repacking():
    last = anchor.markdown(_result() | {"llama_repack": False}).splitlines()[-1]
    assert last.endswith("2 threads; llama.cpp without weight repacking (--no-repack).")


def test_runs_with_failed_requests_are_listed_under_the_table():
    result = _result()
    result["runs"][4]["summary"] = _summary(20.0, 3.0, completed=1,
                                            reasons={"HTTP 500": 1})
    lines = anchor.markdown(result).splitlines()
    assert lines[6:8] == ["- single on duplex, run 2: 1 of 2 requests did not complete "
                          "(HTTP 500 1); details in anchor.json", ""]
    assert anchor.failure_lines(_result()["runs"]) == []


def test_failures_keep_what_went_wrong():
    records = [{"status": "ok", "error": None, "detail": None},
               {"status": "failed", "error": "error in stream", "detail": '{"message": "x"}'}]
    assert anchor.failures({"records": records}) == [
        {"error": "error in stream", "detail": '{"message": "x"}'}]


def test_a_row_without_runs_reads_n_a_and_a_zero_reference_has_no_ratio():
    result = _result() | {"workloads": ["random16"]}
    assert anchor.markdown(result).splitlines()[2] == (
        "| 32 random 100-300-word prompts, 128 out, concurrency 16 | out tok/s n/a, "
        "TTFT p50 n/a, RSS n/a | out tok/s n/a, TTFT p50 n/a, RSS n/a | out tok/s n/a, "
        "TTFT p50 n/a, RSS n/a |")
    assert anchor.ratio(3.0, 0.0) == "n/a"
    assert anchor.ratio(None, 2.0) == "n/a"


# ----- arguments and workloads ---------------------------------------------------------------

def _parse(*argv):
    parser = argparse.ArgumentParser()
    anchor.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_arguments_defaults_and_a_workload_subset():
    args = _parse()
    assert (args.llama_dir, args.threads, args.repeats, args.duplex_url, args.model) == \
        ("/tmp/llamacpp", 2, 3, None, None)
    assert args.workloads == ["single", "random16", "multiturn", "bench"]
    args = _parse("--workloads", "multiturn, single", "--threads", "4", "--duplex-url",
                  "http://127.0.0.1:9000", "--build")
    assert (args.workloads, args.threads, args.duplex_url, args.build) == \
        (["multiturn", "single"], 4, "http://127.0.0.1:9000", True)


def test_unknown_workloads_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse("--workloads", "single,chatty")
    assert exit_info.value.code == 2
    assert "unknown workload(s) chatty" in capsys.readouterr().err


def test_the_default_build_script_sits_in_shared_next_to_the_repository():
    path = anchor.default_build_script()
    assert path.parts[-3:] == ("shared", "anchors", "build-llama-server.sh")
    assert path.parents[2] == anchor.Path(anchor.__file__).resolve().parents[2]


def test_rows_build_the_issues_workloads(text_source):
    single = anchor.spec_workload(anchor.SPECS["single"], text_source, 1)
    assert [text_source.count(c.turns[0].messages[0]["content"]) for c in single.conversations] \
        == [80] * 8
    assert {c.turns[0].max_tokens for c in single.conversations} == {128}
    spread = anchor.spec_workload(anchor.SPECS["random16"], text_source, 1)
    lengths = [text_source.count(c.turns[0].messages[0]["content"]) for c in spread.conversations]
    assert len(lengths) == 32 and min(lengths) >= 130 and max(lengths) <= 390
    assert len(set(lengths)) > 16
    chat = anchor.spec_workload(anchor.SPECS["multiturn"], text_source, 1)
    assert [len(c.turns) for c in chat.conversations] == [4] * 8
    assert (anchor.SPECS["single"].concurrency, anchor.SPECS["random16"].concurrency,
            anchor.SPECS["multiturn"].concurrency) == (1, 16, 8)


def test_the_longest_multi_turn_request_fits_a_llama_server_slot(text_source):
    chat = anchor.spec_workload(anchor.SPECS["multiturn"], text_source, 1)
    conversation = chat.conversations[0]
    history = sum(text_source.count(m["content"]) for t in conversation.turns
                  for m in t.messages)
    replies = sum(t.max_tokens for t in conversation.turns)    # three in the history, one out
    slot = 32768 // 16
    assert history + replies + 64 <= slot                       # 64: chat template room


def test_every_workload_and_repeat_gets_its_own_seed():
    seeds = {anchor.workload_seed(n, 0, r) for n in ("single", "random16") for r in range(3)}
    assert len(seeds) == 6
    assert anchor.workload_seed("single", 0, 1) == anchor.workload_seed("single", 0, 1)


def test_load_config_is_streaming_greedy_ignore_eos():
    target = anchor.Target("llama", "http://127.0.0.1:1", "m")
    load = anchor.load_config(anchor.SPECS["random16"], target, num_requests=5)
    assert (load.url, load.model, load.concurrency, load.num_requests, load.temperature,
            load.ignore_eos, load.progress) == ("http://127.0.0.1:1", "m", 16, 5, 0.0, True,
                                                False)
    assert load.headers == (("Connection", "close"),)    # llama-server drops kept-alive ones


# ----- llama.cpp build layout ----------------------------------------------------------------

def test_find_llama_bin_needs_both_programs(tmp_path):
    bin_dir = tmp_path / "llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-server").write_text("")
    with pytest.raises(RuntimeError, match="--build"):
        anchor.find_llama_bin(str(tmp_path))
    (bin_dir / "llama-bench").write_text("")
    assert anchor.find_llama_bin(str(tmp_path)) == bin_dir


def test_build_llama_takes_the_last_line_of_the_script(tmp_path):
    script = tmp_path / "build.sh"
    script.write_text('echo "building in $1"\necho "$1/x/bin/llama-server"\n')
    assert anchor.build_llama(str(tmp_path / "dir"), str(script)) == tmp_path / "dir/x/bin"


def test_run_without_a_llama_build_fails_plainly(tmp_path, capsys):
    args = _parse("--llama-dir", str(tmp_path), "--out", str(tmp_path / "out"))
    assert anchor.run(args) == 1
    assert "no llama-server and llama-bench under" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sigterm_stops_a_run_like_ctrl_c_and_what_was_measured_is_written(tmp_path, monkeypatch,
                                                                         capsys):
    def measure(args, result):
        result |= _result() | {"workloads": ["single"]}
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)                                   # never reached: SIGTERM interrupts

    monkeypatch.setattr(anchor, "measure", measure)
    before = signal.getsignal(signal.SIGTERM)
    assert anchor.run(_parse("--out", str(tmp_path))) == 130
    assert signal.getsignal(signal.SIGTERM) is before
    assert "interrupted; servers stopped" in capsys.readouterr().err
    assert (tmp_path / "anchor.md").read_text().splitlines()[2].startswith(
        "| one stream, ~60-word prompts, 128 tokens out | 11.0 out tok/s")
    assert json.loads((tmp_path / "anchor.json").read_text())["threads"] == 2


def test_llama_command_lines(tmp_path):
    llama = anchor.LlamaCpp(tmp_path, "m.gguf", 3)
    assert llama.server_command(8101) == [
        str(tmp_path / "llama-server"), "-m", "m.gguf", "-t", "3", "-np", "16", "-c", "32768",
        "--host", "127.0.0.1", "--port", "8101"]
    assert llama.bench_command(512, 128, 3) == [
        str(tmp_path / "llama-bench"), "-m", "m.gguf", "-t", "3", "-p", "512", "-n", "128",
        "-r", "3", "--repack", "1", "-o", "json"]
    plain = llama._replace(repack=False)
    assert "--no-repack" in plain.server_command(1)
    assert plain.bench_command(1, 1, 1)[-4:-2] == ["--repack", "0"]


def _fake_llama_bench(tmp_path, body):
    (tmp_path / "llama-bench").write_text("#!/bin/sh\n" + body + "\n")
    (tmp_path / "llama-bench").chmod(0o755)
    return tmp_path


def test_repack_auto_turns_off_when_the_probe_dies_of_sigill(tmp_path):
    assert anchor.choose_repack("auto", _fake_llama_bench(tmp_path, "kill -ILL $$"), "m", 1) \
        is False
    assert anchor.choose_repack("auto", _fake_llama_bench(tmp_path, "exit 0"), "m", 1) is True
    with pytest.raises(subprocess.CalledProcessError):
        anchor.choose_repack("auto", _fake_llama_bench(tmp_path, "exit 1"), "m", 1)
    missing = tmp_path / "nowhere"                    # on / off never run the probe
    assert (anchor.choose_repack("on", missing, "m", 1),
            anchor.choose_repack("off", missing, "m", 1)) == (True, False)


# ----- server start and stop -----------------------------------------------------------------

_FAKE_SERVER = textwrap.dedent("""\
    import http.server, sys, time
    time.sleep(float(sys.argv[2]))
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
    print("ready", flush=True)
    server.serve_forever()
    """)


def _fake_server(port, delay_s=0.2):
    return [sys.executable, "-c", _FAKE_SERVER, str(port), str(delay_s)]


def test_running_command_waits_for_health_logs_and_stops(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    with anchor.running_command(_fake_server(port), port, log, timeout_s=20) as proc:
        assert anchor.is_healthy(f"http://127.0.0.1:{port}/health")
        assert proc.poll() is None
    assert proc.returncode == -15                       # SIGTERM to its process group
    assert not anchor.is_healthy(f"http://127.0.0.1:{port}/health")
    assert log.read_text() == "ready\n"


def test_running_command_stops_the_server_on_ctrl_c():
    port = free_port()
    with pytest.raises(KeyboardInterrupt):
        with anchor.running_command(_fake_server(port), port, timeout_s=20) as proc:
            raise KeyboardInterrupt
    assert proc.returncode == -15


def test_running_command_reports_a_server_that_exits_or_never_gets_healthy():
    port = free_port()
    with pytest.raises(RuntimeError, match="server exited with 3"):
        with anchor.running_command([sys.executable, "-c", "raise SystemExit(3)"], port):
            pass
    with pytest.raises(RuntimeError, match="not healthy after 0.5 s"):
        with anchor.running_command(_fake_server(port, delay_s=60), port, timeout_s=0.5):
            pass


def test_stop_group_kills_a_server_that_ignores_sigterm():
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('armed', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout.readline() == b"armed\n"
    anchor.stop_group(proc, grace_s=0.2)
    assert proc.returncode == -9
    proc.stdout.close()


# ----- side by side against fake servers -----------------------------------------------------

def test_compare_serving_alternates_servers_and_sends_both_the_same_prompts(tokenizer):
    servers = {name: FakeOpenAI(chunk_delay_s=0.001).start() for name in anchor.SERVERS}
    try:
        targets = [anchor.Target(name, servers[name].url, "ok") for name in anchor.SERVERS]
        spec = anchor.Spec("tiny", (anchor.OUT_TOK_S,), "random",
                           {"num_requests": 2, "input_len": 8, "output_len": 3})
        runs = anchor.compare_serving(targets, {"tiny": spec}, tokenizer, repeats=2)
    finally:
        for server in servers.values():
            server.stop()
    assert [(r["workload"], r["server"], r["repeat"]) for r in runs] == [
        ("tiny", "llama", 0), ("tiny", "duplex", 0), ("tiny", "duplex", 1), ("tiny", "llama", 1)]
    assert [(r["summary"]["completed"], r["failures"]) for r in runs] == [(2, [])] * 4
    llama, duplex = (servers[name].bodies for name in anchor.SERVERS)
    assert len(llama) == len(duplex) == 2 + 4                  # warm-up, then two repeats
    assert [b["messages"] for b in llama] == [b["messages"] for b in duplex]
    assert llama[2]["messages"] != llama[4]["messages"]        # a new seed per repeat
    assert {(b["stream"], b["temperature"], b["ignore_eos"], b["max_tokens"])
            for b in llama[2:]} == {(True, 0.0, True, 3)}
    assert {h["Connection"] for h in servers["llama"].headers} == {"close"}


# ----- the offline decode-step profile -------------------------------------------------------

_TINY = types.SimpleNamespace(num_heads=4, head_dim=8, num_kv_heads=2, hidden_size=32,
                              intermediate_size=48, num_layers=3, vocab_size=100)


def test_step_profile_uses_one_distinct_weight_per_layer_gemm():
    weights = step_weights(_TINY)
    layer = [(64, 32), (32, 32), (96, 32), (32, 48)]
    assert [tuple(w.shape) for w in weights] == layer * 3 + [(100, 32)]
    assert step_gemms(_TINY) == layer * 3 + [(100, 32)]
    assert len({w.data_ptr() for w in weights}) == 13


def test_isolated_gemm_flop_count_covers_every_layer():
    seconds, gflop = isolated_gemm_seconds(_TINY, m=2, repeats=2)
    flop = 2 * 2 * (3 * (64 * 32 + 32 * 32 + 96 * 32 + 32 * 48) + 100 * 32)
    assert gflop == pytest.approx(flop / 1e9, rel=1e-12)
    assert seconds > 0


def test_tree_rss_counts_a_group_and_descendants_in_sessions_of_their_own():
    import os
    own = anchor.tree_rss_mb(os.getpgid(0))
    assert own is not None and own > 10  # this interpreter alone holds more than 10 MB
    assert anchor.tree_rss_mb(2**22 + 12345) is None  # no such process or group
    # a parent in a group of its own, its child in a new session holding ~200 MB
    code = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', "
            "'import sys; b = bytearray(200 * 2**20); print(1, flush=True); sys.stdin.read()'], "
            "start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE); "
            "child.stdout.readline(); print(1, flush=True); sys.stdin.read(); child.kill()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout.readline() == b"1\n"
        assert anchor.tree_rss_mb(parent.pid) > 200
    finally:
        parent.kill()
        parent.wait()

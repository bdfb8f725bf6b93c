"""`duplex bench anchor --vllm-python`: vLLM's CPU build as the second anchor, without vLLM.

A fake `vllm` package (an OpenAI-style streaming server behind the real module path) stands in
for the CPU build: the command line, its environment, the prompts it gets (the same as the
pair's) and the table's vLLM column are checked; where vLLM cannot run, the reason is kept."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from duplex.bench import anchor, vllm_anchor

_SERVER = '''
import json, os, sys
from aiohttp import web
sys.path.insert(0, os.environ["FAKE_VLLM_FAKES"])
from bench_fakes import FakeOpenAI

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
name = argv[argv.index("--served-model-name") + 1]
log = open(os.environ["FAKE_VLLM_LOG"], "a")
log.write(json.dumps({"argv": argv, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                      "kv": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}) + "\\n")
log.flush()
fake = FakeOpenAI(chunk_delay_s=0.001)

async def chat(request):
    response = await fake._chat(request)
    log.write(json.dumps({"body": fake.bodies[-1]}) + "\\n")
    log.flush()
    return response

async def health(request):
    return web.Response(text="ok")

async def models(request):
    return web.json_response({"data": [{"id": name}]})

app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=port, print=None)
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A `python` whose `vllm` is the fake above; returns (its path, the log of its calls)."""
    package = tmp_path / "site" / "vllm"
    (package / "entrypoints" / "openai").mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.0.fake"\n')
    (package / "entrypoints" / "__init__.py").write_text("")
    (package / "entrypoints" / "openai" / "__init__.py").write_text("")
    (package / "entrypoints" / "openai" / "api_server.py").write_text(_SERVER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}:$PYTHONPATH" '
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("FAKE_VLLM_FAKES", str(Path(__file__).parent))
    return str(python), log


def test_unavailable_says_why(tmp_path):
    assert vllm_anchor.unavailable(None) == "no --vllm-python given"
    assert "does not exist" in vllm_anchor.unavailable(str(tmp_path / "nope"))
    reason = vllm_anchor.unavailable(sys.executable)  # the project's venv has no vllm
    assert reason.startswith(f"vllm does not import in {sys.executable}")
    assert "vllm" in reason.split(":", 1)[1]


def test_a_quantized_shape_file_hands_vllm_the_f16_file_it_came_from(tmp_path):
    quantized = tmp_path / "random-1b-Q4_K_M.gguf"
    quantized.touch()
    assert vllm_anchor.source_gguf(str(quantized)) == str(quantized)  # no F16 beside it
    (tmp_path / "random-1b-F16.gguf").touch()
    assert vllm_anchor.source_gguf(str(quantized)) == str(tmp_path / "random-1b-F16.gguf")
    assert vllm_anchor.source_gguf(str(tmp_path / "random-1b-F16.gguf")) == \
        str(tmp_path / "random-1b-F16.gguf")
    plain = tmp_path / "SmolLM2.Q4_1.gguf"
    assert vllm_anchor.source_gguf(str(plain)) == str(plain)


def test_a_made_directory_is_reused(tmp_path):
    made = tmp_path / "m.hf"
    made.mkdir()
    (made / "config.json").write_text("{}")
    assert vllm_anchor.hf_dir(str(tmp_path / "m.gguf")) == made
    elsewhere = tmp_path / "cache"
    (elsewhere / "m.hf").mkdir(parents=True)
    (elsewhere / "m.hf" / "config.json").write_text("{}")
    assert vllm_anchor.hf_dir("/nowhere/m.gguf", elsewhere) == elsewhere / "m.hf"


def _args(tmp_path, python):
    return anchor_args(["--vllm-python", python, "--out", str(tmp_path / "out"),
                        "--threads", "2", "--repeats", "2"])


def anchor_args(argv):
    import argparse
    parser = argparse.ArgumentParser()
    anchor.add_arguments(parser)
    return parser.parse_args(argv)


def test_vllm_runs_the_pairs_prompts_alone_and_gets_a_column(tmp_path, fake_vllm, tokenizer,
                                                             monkeypatch):
    python, log = fake_vllm
    model_dir = tmp_path / "weights.hf"
    monkeypatch.setattr(vllm_anchor, "hf_dir", lambda gguf, root=None: model_dir)
    spec = anchor.Spec("tiny", (anchor.OUT_TOK_S, anchor.RSS), "random",
                       {"num_requests": 2, "input_len": 8, "output_len": 3})
    result = {"runs": [], "workloads": ["single"], "repeats": 2, "model": "m.gguf",
              "threads": 2}
    monkeypatch.setattr(anchor, "load_tokenizer", lambda model: tokenizer, raising=False)
    import duplex.bench.hf as hf
    monkeypatch.setattr(hf, "load_tokenizer", lambda model=None: tokenizer)
    anchor.serve_vllm(_args(tmp_path, python), "m.gguf", {"single": spec}, result)

    assert result["vllm_version"] == "0.0.fake"
    runs = result["runs"]
    assert [(r["workload"], r["server"], r["repeat"]) for r in runs] == \
        [("single", "vllm", 0), ("single", "vllm", 1)]
    assert all(r["summary"]["completed"] == 2 and r["summary"]["rss_mb"] > 0 for r in runs)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    start = calls[0]
    assert start["argv"][start["argv"].index("--model") + 1] == str(model_dir)
    assert start["argv"][start["argv"].index("--dtype") + 1] == "bfloat16"
    assert start["argv"][start["argv"].index("--host") + 1] == "127.0.0.1"
    assert (start["bind"], start["kv"]) == ("0-1", str(vllm_anchor.KV_CACHE_GIB))
    bodies = [c["body"] for c in calls[1:]]
    assert len(bodies) == 2 + 4                               # warm-up, then two repeats
    # the prompts the pair got in the same repeat: the same seeds
    from duplex.bench.text import TextSource
    expected = anchor.spec_workload(spec, TextSource(tokenizer, seed=0),
                                    anchor.workload_seed("single", 0, 0))
    assert {b["messages"][-1]["content"] for b in bodies[2:4]} == \
        {c.turns[0].messages[-1]["content"] for c in expected.conversations}
    assert (tmp_path / "out" / "vllm.log").is_file()


def test_the_table_gets_a_vllm_column_and_duplex_over_vllm_ratios():
    summary = {"output_throughput": 0.0, "tpot_ms": {"p50": None}, "rss_mb": None,
               "num_planned": 1, "completed": 1, "failure_reasons": {}}
    runs = [{"workload": "single", "server": s, "repeat": 0,
             "summary": summary | {"output_throughput": out, "tpot_ms": {"p50": tpot},
                                   "rss_mb": rss}}
            for s, out, tpot, rss in (("llama", 10.0, 100.0, 1000.0),
                                      ("duplex", 20.0, 50.0, 1200.0),
                                      ("vllm", 5.0, 200.0, 3000.0))]
    result = {"workloads": ["single"], "runs": runs, "repeats": 1, "model": "m.gguf",
              "threads": 2, "vllm_version": "0.32.0"}
    table = anchor.markdown(result)
    assert table.splitlines()[:3] == [
        "| workload | llama-server | Duplex | ratio | vLLM CPU | Duplex / vLLM |",
        "|---|---|---|---|---|---|",
        "| one stream, ~60-word prompts, 128 tokens out | 10.0 out tok/s, TPOT 100.0 ms, "
        "RSS 1000 MB | 20.0 out tok/s, TPOT 50.0 ms, RSS 1200 MB | out tok/s 2.00x, "
        "TPOT 0.50x, RSS 1.20x | 5.0 out tok/s, TPOT 200.0 ms, RSS 3000 MB | "
        "out tok/s 4.00x, TPOT 0.25x |"]
    assert "vLLM 0.32.0 (CPU build) ran the same prompts alone" in table
    skipped = anchor.markdown({**result, "runs": runs[:2], "vllm_skipped": "no vllm here"})
    assert "vLLM CPU" not in skipped.splitlines()[0]
    assert "vLLM not run: no vllm here." in skipped


def one_stream_result(runs: list[tuple[int, str, dict]], read_gbs: float) -> dict:
    """anchor.json's shape for one-stream runs (repeat, server, summary fields) of 1 GB."""
    summary = {"num_planned": 1, "completed": 1, "failure_reasons": {}, "rss_mb": None}
    return {"workloads": ["single"], "repeats": 1 + max(r for r, _, _ in runs), "model": "m.gguf",
            "threads": 2, "read_gbs": read_gbs, "weight_bytes": 1_000_000_000,
            "runs": [{"workload": "single", "server": s, "repeat": r, "summary": summary | fields}
                     for r, s, fields in runs]}


def test_the_read_rate_line_sets_each_servers_weight_bytes_a_second_against_the_box():
    result = one_stream_result([(0, s, {"output_throughput": 1.0, "tpot_ms": {"p50": tpot}})
                                for s, tpot in (("llama", 100.0), ("duplex", 200.0))], 20.0)
    assert anchor.read_rate_line(result) == (
        "One stream reads the 1.00 GB of weights a token: llama-server 10.0 GB/s (50%), "
        "Duplex 5.0 GB/s (25%) of the box's measured streaming read rate, 20.0 GB/s with 2 "
        "threads.")
    assert anchor.read_rate_line(result) in anchor.markdown(result)
    assert anchor.read_rate_line({**result, "read_gbs": None}) is None


def test_each_one_stream_run_is_set_against_the_rate_measured_just_before_it():
    # the box streams 20 GB/s before llama-server's runs and 40 before Duplex's: the same
    # 10 GB/s is 50 % of the one and 25 % of the other; medians over the runs
    result = one_stream_result(
        [(r, s, {"tpot_ms": {"p50": tpot}, "read_gbs": gbs}) for r in range(3)
         for s, tpot, gbs in (("llama", 100.0, 20.0), ("duplex", (100.0, 50.0, 100.0)[r], 40.0))],
        30.0)
    assert anchor.read_rate_line(result) == (
        "One stream reads the 1.00 GB of weights a token: llama-server 10.0 GB/s (50%), "
        "Duplex 10.0 GB/s (25%) of the box's measured streaming read rate, 20.0-40.0 GB/s "
        "with 2 threads.")


def test_compare_serving_probes_the_box_before_each_one_stream_run_only(monkeypatch):
    import sys
    import types
    calls = []
    fake = types.ModuleType("duplex.bench.serve")
    fake.bench = lambda workload, config: calls.append(("run", config.url)) or {
        "summary": {"tpot_ms": {"p50": 1.0}}, "records": []}
    monkeypatch.setitem(sys.modules, "duplex.bench.serve", fake)
    monkeypatch.setattr(anchor, "warm_up", lambda targets, tokenizer: None)
    monkeypatch.setattr(anchor, "spec_workload", lambda spec, text, seed: [])
    monkeypatch.setattr(anchor, "tree_rss_mb", lambda pgid: None)
    import duplex.bench.text as text
    monkeypatch.setattr(text, "TextSource", lambda tokenizer, seed: None)
    targets = [anchor.Target(s, f"http://{s}", "m", 0) for s in anchor.SERVERS]
    rates = iter([31.0, 32.0, 33.0, 34.0])
    runs = anchor.compare_serving(targets, {n: anchor.SPECS[n] for n in ("single", "random16")},
                                  None, repeats=2, probe=lambda: calls.append("probe") or next(rates))
    assert calls.count("probe") == 4  # the two servers' one-stream runs, twice; not random16's
    assert [c for c in calls if c == "probe" or c[1]][:2] == ["probe", ("run", "http://llama")]
    assert [r["summary"].get("read_gbs") for r in runs] == [31.0, 32.0, None, None, 33.0, 34.0,
                                                            None, None]


def test_read_rates_count_the_files_tensor_bytes(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("b", np.zeros((16,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    rates = anchor.read_rates(str(path), threads=1)
    assert rates["weight_bytes"] == 4 * 8 * 4 + 16 * 2
    assert rates["read_gbs"] > 0.1


@pytest.mark.parametrize("tied", [True, False])
def test_the_weights_vllm_gets_are_transformers_own_reading_of_the_file(tmp_path, tied):
    """hf_dir's tensor-at-a-time conversion (shards, never the whole model in fp32) against
    transformers' whole-file reader (bench.hf.load_model): the same names, the same bf16
    values (Llama's q/k rows un-permuted the same way), the tokenizer beside them; tiny
    shards force several files and the index."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from duplex.bench import shapes
    from duplex.bench.hf import load_model
    from duplex.engine.config import default_model_path

    shape = shapes.SHAPES["tiny"]._replace(tied=tied)
    gguf = shapes.write_gguf(shape, tmp_path / "tiny-F16.gguf", default_model_path())
    out = tmp_path / "staging"
    out.mkdir()
    vllm_anchor.write_weights(Path(gguf), out, shard_bytes=2 << 20)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    streamed = {}
    for f in files:
        streamed.update(load_file(str(out / f)))
    reference = {n: t.to(torch.bfloat16) for n, t in load_model(str(gguf)).state_dict().items()}
    if tied:
        reference.pop("lm_head.weight")
    assert set(streamed) == set(reference) == set(index["weight_map"])
    for name, tensor in reference.items():
        assert streamed[name].dtype == torch.bfloat16
        assert torch.equal(streamed[name], tensor), name
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in streamed.values())
    # and transformers loads the directory as a model (what vLLM is handed)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert model.config.tie_word_embeddings == tied


def test_hf_dir_makes_the_directory_with_its_tokenizer(tmp_path):
    from duplex.bench import shapes
    from duplex.engine.config import default_model_path

    gguf = shapes.write_gguf(shapes.SHAPES["tiny"], tmp_path / "t-F16.gguf", default_model_path())
    made = vllm_anchor.hf_dir(str(gguf), tmp_path / "cache")
    assert made == tmp_path / "cache" / "t-F16.hf"
    assert (made / "config.json").is_file() and (made / "tokenizer.json").is_file()
    assert not (tmp_path / "cache" / "t-F16.hf.tmp").exists()


def test_vllms_kv_cache_is_the_options_size_or_the_default():
    assert vllm_anchor.environment(2)["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_anchor.KV_CACHE_GIB)
    args = anchor_args(["--vllm-kv-gib", "2"])
    assert vllm_anchor.environment(2, args.vllm_kv_gib)["VLLM_CPU_KVCACHE_SPACE"] == "2"

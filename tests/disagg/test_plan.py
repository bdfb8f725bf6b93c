"""`duplex plan`: workloads from a trace or a bench result, the layout model, and the ratio it
recommends moving with where the work is (prefill-heavy vs decode-heavy)."""
from __future__ import annotations

import json

from duplex.engine.cost_model import CostModel
from duplex.engine.plan_cli import (PlanRequest, add_arguments, calibrate, decode_tpot, load_workload,
                             plan, run)
from duplex.frontend.cli import build_parser

from .conftest import tiny_model

MODEL = CostModel(coef=[1e-3, 1e-4, 2e-3, 2e-2])  # s per token, per k pairs, per seq, step


def trace(path, num: int, prompt: int, output: int, gap_ms: int, shared: bool = True) -> str:
    with open(path, "w") as f:
        for i in range(num):
            # shared: every prompt starts with the same two 512-token blocks
            hash_ids = ([0, 1] if shared else []) + [100 + i]
            f.write(json.dumps({"timestamp": i * gap_ms, "input_length": prompt,
                                "output_length": output, "hash_ids": hash_ids}) + "\n")
    return str(path)


def test_trace_and_bench_result_workloads(tmp_path):
    requests = load_workload(trace(tmp_path / "t.jsonl", 3, 1500, 20, 500))
    assert requests[0] == PlanRequest(0.0, 1500, 0, 20)
    assert requests[1] == PlanRequest(0.5, 1500, 1024, 20)  # hash ids 0, 1 seen before
    bench = {"records": [
        {"status": "ok", "send_s": 1.5, "prompt_tokens": 40, "cached_tokens": 16,
         "completion_tokens": 9},
        {"status": "failed", "send_s": 0.1, "prompt_tokens": None},
        {"status": "ok", "send_s": 0.5, "prompt_tokens": 80, "completion_tokens": 3}]}
    (tmp_path / "b.json").write_text(json.dumps(bench))
    assert load_workload(str(tmp_path / "b.json")) == [PlanRequest(0.5, 80, 0, 3),
                                                         PlanRequest(1.5, 40, 16, 9)]


def test_decode_fixed_point_and_saturation():
    tpot, streams = decode_tpot(MODEL, rate=1.0, mean_output=100, mean_context=500,
                                num_decode=1)
    per_stream = 2e-3 + 1e-4 * 0.5
    assert streams > 1 and abs(tpot - (2e-2 + per_stream * streams)) < 1e-9
    assert abs(streams - 100 * (2e-2 + per_stream * streams)) < 1e-9  # Little's law
    light, _ = decode_tpot(MODEL, 0.01, 10, 500, 1)
    assert light == 2e-2 + per_stream  # never below one stream's step
    assert decode_tpot(MODEL, 10.0, 100, 500, 1) == (float("inf"), float("inf"))


def test_the_ratio_follows_the_work(tmp_path):
    def best(prompt: int, output: int):
        requests = load_workload(trace(tmp_path / f"{prompt}.jsonl", 60, prompt, output, 1000,
                                       shared=False))
        layout, layouts = plan(requests, MODEL, MODEL, ttft_s=3.0, tpot_s=0.15,
                               max_workers=8, chunk=512)
        assert layout is not None and layout.meets(3.0, 0.15)
        smaller = [lay for lay in layouts
                   if lay.num_prefill + lay.num_decode < layout.num_prefill + layout.num_decode]
        assert not any(lay.meets(3.0, 0.15) for lay in smaller)
        return layout

    prefill_heavy, decode_heavy = best(2000, 20), best(200, 800)
    assert prefill_heavy.num_prefill > prefill_heavy.num_decode
    assert decode_heavy.num_decode > decode_heavy.num_prefill


def test_cli_with_a_saved_cost_model(tmp_path, capsys):
    model_path = tmp_path / "cost.json"
    model_path.write_text(json.dumps({"worker_id": "p0", "cost_model": MODEL.to_dict()}))
    workload = trace(tmp_path / "t.jsonl", 40, 1000, 50, 500)
    args = build_parser(only="plan").parse_args(
        ["plan", "--workload", workload, "--cost-model", str(model_path), "--json"])
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"]["num_prefill"] >= 1 and len(out["layouts"]) == 28
    args = build_parser(only="plan").parse_args(["plan", "--workload", workload])
    assert run(args) == 2 and "--calibrate" in capsys.readouterr().err
    assert add_arguments


def test_calibration_fits_a_model():
    model = calibrate(tiny_model(), num_threads=1, max_tokens=64)
    assert model.is_fitted and model.num_samples >= 8

"""bench/eplb.py: the simulator behind `duplex bench eplb`, run small and fast."""
import argparse
import json

import numpy as np
import pytest

from duplex.bench import eplb as bench_eplb


def parse(*argv):
    parser = argparse.ArgumentParser()
    bench_eplb.add_arguments(parser)
    return parser.parse_args(list(argv))


def run_json(tmp_path, *argv):
    out = tmp_path / "eplb.json"
    assert bench_eplb.run(parse(*argv, "--out", str(out))) == 0
    return json.loads(out.read_text())


def test_defaults_are_the_deepseek_v3_layout():
    args = parse()
    assert (args.ranks, args.experts, args.top_k, args.redundant) == (64, 256, 8, 32)
    assert args.bytes_per_expert == 3 * 7168 * 2048  # ~44 MB in fp8


def test_zipf_target_64_ranks_256_experts_32_redundant(tmp_path, capsys):
    result = run_json(tmp_path, "--workload", "zipf", "--zipf-s", "1.0", "--layers", "2",
                      "--steps", "120", "--interval", "60")
    summary = result["summary"]
    assert result["config"]["slots_per_rank"] == [4, 5]
    assert summary["window_identity"] > 5.0  # before: the hottest rank carries >5x the mean
    assert summary["window_balanced"] <= 1.10  # after, on the load it was computed from
    assert summary["expected_balanced"] <= 1.10  # and on the true (noise-free) load
    assert summary["sampled_balanced"] < 1.2  # one step's counts add batch noise
    for rebalance in result["rebalances"]:
        assert rebalance["bytes_moved"] == rebalance["num_moves"] * 3 * 7168 * 2048
    assert "| load measured on | identity (no replicas) | balanced |" in capsys.readouterr().out


def test_drift_timeline_and_plot(tmp_path):
    png = tmp_path / "drift.png"
    result = run_json(tmp_path, "--workload", "drift", "--drift-period", "5", "--ranks", "8",
                      "--experts", "32", "--redundant", "8", "--top-k", "2", "--layers", "1",
                      "--steps", "40", "--interval", "10", "--table-every", "5",
                      "--plot", str(png))
    rows = result["timeline"]
    assert [(r["first_step"], r["last_step"]) for r in rows] == [(i, i + 4) for i in
                                                                 range(0, 40, 5)]
    assert sum(r["num_rebalances"] for r in rows) == len(result["rebalances"]) >= 2
    # right after a rebalance the placement beats identity; drift erodes that over time
    assert rows[2]["expected_balanced"] < rows[2]["expected_identity"]
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_recorded_trace(tmp_path, suffix):
    rng = np.random.default_rng(0)
    counts = rng.poisson(np.linspace(50, 1, 16), size=(30, 2, 16))  # [steps, layers, experts]
    path = tmp_path / f"trace{suffix}"
    if suffix == ".npy":
        np.save(path, counts)
    else:
        path.write_text(json.dumps({"counts": counts.tolist()}))
    result = run_json(tmp_path, "--trace", str(path), "--ranks", "4", "--redundant", "4",
                      "--interval", "10")
    assert result["config"]["num_layers"] == 2 and result["config"]["num_experts"] == 16
    assert result["config"]["num_steps"] == 30
    assert result["summary"]["expected_balanced"] is None  # a recording has no ground truth
    assert result["summary"]["window_balanced"] < result["summary"]["window_identity"]


def test_bad_trace_is_reported_not_raised(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("[[1, 2], [3, 4]]")
    assert bench_eplb.run(parse("--trace", str(path))) == 2
    assert "counts [steps, layers, experts]" in capsys.readouterr().err


def test_selection_probabilities_sum_to_top_k():
    rng = np.random.default_rng(0)
    probs = bench_eplb.selection_probabilities(1.0, 64, 4, rng, num_tokens=4000)
    assert probs.sum() == pytest.approx(4.0)
    assert (probs <= 1.0).all() and (np.diff(probs[:8]) < 0).all()
    assert bench_eplb.selection_probabilities(1.0, 4, 4, rng).tolist() == [1.0] * 4

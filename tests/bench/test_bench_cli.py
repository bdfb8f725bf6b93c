"""The `duplex bench` dispatcher and the machine figures."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from duplex.bench import machine
from duplex.frontend import cli as duplex_cli


@pytest.mark.parametrize("name", ["offline", "eplb"])
def test_missing_benchmarks_say_not_available(name, capsys, monkeypatch):
    module = f"duplex.bench.{name}"
    monkeypatch.setitem(sys.modules, module, None)       # as if the module were not built
    assert duplex_cli.main(["bench", name, "--any", "flag"]) == 2
    assert f"duplex bench {name}: not available" in capsys.readouterr().err


def test_subcommands_import_only_their_module(tmp_path):
    result = {"label": "a", "summary": {"completed": 1, "ttft_ms": {"p50": 2.0}}}
    path = tmp_path / "a.json"
    path.write_text(json.dumps(result))
    code = ("import sys; from duplex.frontend.cli import main; rc = main(['bench', 'compare', "
            f"{str(path)!r}]); print('LOADED', sorted(m for m in ('aiohttp', 'torch', "
            "'duplex.bench.serve', 'duplex.bench.baseline_server') if m in sys.modules), rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "| TTFT p50 (ms) | 2.000 |" in out
    assert out.strip().endswith("LOADED [] 0")


def test_parse_shapes():
    assert machine.parse_shapes("1x2x3, 4X5X6") == ((1, 2, 3), (4, 5, 6))
    with pytest.raises(ValueError):
        machine.parse_shapes("1x2")


def test_machine_figures_are_positive():
    assert machine.matmul_gflops(32, 32, 32, min_time_s=0.01) > 0
    assert machine.memory_bandwidth_gbs(2**20, min_time_s=0.01) > 0


def test_decode_utilization_arithmetic():
    summary = {"output_throughput": 100.0, "itl_ms": {"p50": 20.0}}
    figures = {"peak_gflops": 50.0, "bandwidth_gbs": 20.0}
    u = machine.decode_utilization(summary, figures, gflop_per_token=0.27, bytes_per_step=5.4e8)
    assert u["achieved_gflops"] == pytest.approx(27.0)
    assert u["compute_fraction"] == pytest.approx(0.54)
    assert u["achieved_gbs"] == pytest.approx(27.0)        # 50 steps/s × 0.54 GB
    assert u["bandwidth_fraction"] == pytest.approx(1.35)
    assert machine.decode_utilization(summary, figures, None, None) == {}

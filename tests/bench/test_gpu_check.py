"""duplex.bench.gpu_check runs end to end on the CPU in --quick mode: every section is in the report,
the CUDA-only ones say why they were skipped, the CPU-runnable ones produce numbers; and its
kernel comparison reads the same values through the paged and the contiguous layout."""
from __future__ import annotations

import argparse
import json

import torch

from duplex.bench import cli, gpu_check


def quick_args(out) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--quick", "--out", str(out)])


def test_kernel_case_agrees_with_sdpa_on_contiguous_kv():
    # before the full run below: after it, triton's interpreter refused these kernels in
    # one process ("Cannot call @triton.jit'd outside of the scope of a kernel")
    import duplex.kernels._triton  # noqa: F401  (the interpreter flag, before triton loads)

    row = gpu_check.kernel_case("smollm2-135m", 2, 40, torch.device("cpu"), torch.float32,
                                bandwidth_gbs=10.0, iters=1)
    assert row["max_abs_diff"] < 1e-5
    assert row["triton_ms"] > 0 and row["sdpa_ms"] > 0 and row["floor_ms"] > 0
    prefill = gpu_check.kernel_case("smollm2-135m", 2, 40, torch.device("cpu"), torch.float32,
                                    bandwidth_gbs=10.0, num_queries=40, iters=1, tflops=1e-3)
    assert prefill["max_abs_diff"] < 1e-5 and prefill["floor_ms"] > row["floor_ms"]


def test_mla_case_agrees_with_the_torch_path():
    import duplex.kernels._triton  # noqa: F401  (the interpreter flag, before triton loads)

    row = gpu_check.mla_case(2, 40, torch.device("cpu"), torch.float32, bandwidth_gbs=10.0,
                             iters=1, dims=(32, 8, 4), block_size=16)
    assert row["max_abs_diff"] < 1e-5
    assert row["triton_ms"] > 0 and row["torch_ms"] > 0
    assert row["floor_ms"] == 2 * 40 * 40 * 4 / 10e9 * 1e3  # latent bytes / bandwidth


def test_quick_cpu_run_reports_every_section(tmp_path):
    assert gpu_check.run(quick_args(tmp_path)) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    for name in gpu_check.CUDA_ONLY:
        assert sections[name]["status"] == "skipped: no CUDA"
    probes = sections["probes"]
    assert probes["status"] == "ok" and probes["copy_gbs"] > 0 and probes["bf16_tflops"] > 0
    greedy = sections["greedy"]
    assert greedy["status"] == "ok"
    assert set(greedy["models"]) == {"llama", "qwen3", "gemma3", "mixtral", "deepseek_v3"}
    assert all(row["float32"]["equal"] and row["float32_pass"]
               for row in greedy["models"].values())
    assert sections["batch_invariant"]["status"] == "ok"
    assert sections["batch_invariant"]["modes"]["on"]["differing_tokens_or_logprobs"] == 0
    decode = sections["decode"]
    assert decode["status"] == "ok" and len(decode["rows"]) == 4
    assert all(row["ms_per_step"] > 0 and row["floor_ms"] > 0 for row in decode["rows"])
    assert all(row["overlap"] and row["sync_ms_per_step"] > 0 for row in decode["rows"])
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in gpu_check.SECTIONS)


def test_an_exhausted_budget_skips_the_rest_with_a_note(tmp_path):
    args = quick_args(tmp_path)
    args.budget_s = 0.0
    report = gpu_check.run_all(args)
    statuses = {name: r["status"] for name, r in report["sections"].items()}
    assert statuses["probes"].startswith("skipped: time budget")
    assert statuses["greedy"].startswith("skipped: time budget")
    assert statuses["kernels"] == "skipped: no CUDA"


def test_registered_as_duplex_bench_gpu():
    assert cli.SUBCOMMANDS["gpu"][0] == "duplex.bench.gpu_check"
    assert gpu_check.gpu_test_files()  # the gpu-marked files pytest_gpu collects

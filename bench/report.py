"""Benchmark reports: the JSON result file, the Markdown summary and the PNG plots.

A result file holds everything needed to recompute or compare a run: command line, machine
figures, workload and load settings, the summary and every per-request record. A sweep file
lists one summary per request rate.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from duplex.bench import metrics
from duplex.bench.record import RequestRecord

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "e2e"))


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def machine_markdown(machine: dict | None) -> str:
    if not machine:
        return "Machine: not measured (--skip-machine)."
    gemms = ", ".join(f"{g['m']}x{g['n']}x{g['k']}: {g['gflops']:.1f}" for g in machine["gemm"])
    return (f"Machine: {machine['cpu']}, {machine['num_cpus']} CPUs, torch "
            f"{machine['torch']} ({machine['torch_threads']} threads, {machine['device']}) — "
            f"fp32 GEMM GFLOP/s [MxNxK] {gemms}; peak {machine['peak_gflops']:.1f} GFLOP/s; "
            f"memory bandwidth {machine['bandwidth_gbs']:.1f} GB/s (copy, read + write).")


def run_markdown(result: dict) -> str:
    summary = result["summary"]
    lines = [f"## duplex bench: {result['label']}", "",
             f"Workload `{result['workload']['name']}` {_params(result['workload']['params'])}; "
             f"{_mode(result)}; server {result['url']}.", "",
             machine_markdown(result.get("machine")), "",
             "| metric | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in _counts(summary)]
    lines += ["", "| latency (ms) | mean | p50 | p90 | p99 | count |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, name in LATENCIES:
        d = summary[key]
        cells = " | ".join(_num(d[k]) for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"| {name} | {cells} | {d['count']} |")
    lines += _utilization_lines(result.get("utilization") or {})
    return "\n".join(lines) + "\n"


def sweep_markdown(sweep: dict) -> str:
    lines = [f"## duplex bench sweep: {sweep['label']}", "", machine_markdown(sweep.get("machine")),
             "", "| rate (req/s) | completed | failed | rejected | req/s | output tok/s | "
             "goodput | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 | cache hit |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for point in sweep["points"]:
        s = point["summary"]
        cells = [_num(point["request_rate"]), s["completed"], s["failed"], s["rejected"],
                 _num(s["request_throughput"]), _num(s["output_throughput"]), _num(s["goodput"]),
                 _num(s["ttft_ms"]["p50"]), _num(s["ttft_ms"]["p99"]),
                 _num(s["tpot_ms"]["p50"]), _num(s["itl_ms"]["p50"]), _pct(s["cache_hit_rate"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _counts(summary: dict) -> list[tuple[str, str]]:
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["failure_reasons"].items())
    slo = summary["slo"]
    limits = ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v} ms" for k, v in slo.items()
                       if v is not None)
    return [
        ("completed / planned", f"{summary['completed']} / {summary['num_planned']}"),
        ("failed", f"{summary['failed']}" + (f" ({reasons})" if reasons else "")),
        ("rejected (429/503)", str(summary["rejected"])),
        ("cancelled at deadline", str(summary["cancelled"])),
        ("not sent", str(summary["not_sent"])),
        ("duration (s)", _num(summary["duration_s"])),
        ("request throughput (req/s)", _num(summary["request_throughput"])),
        ("output throughput (tok/s)", _num(summary["output_throughput"])),
        ("total token throughput (tok/s)", _num(summary["total_token_throughput"])),
        ("goodput (req/s)", _num(summary["goodput"]) + (f" ({limits})" if limits else "")),
        ("prompt / output tokens", f"{summary['prompt_tokens']} / {summary['output_tokens']}"),
        ("input-token cache hit rate", _pct(summary["cache_hit_rate"])),
        ("speculative acceptance", _pct(summary["spec_acceptance"])),
    ]


def _utilization_lines(utilization: dict) -> list[str]:
    lines = []
    if "compute_fraction" in utilization:
        lines.append(f"Decode compute: {utilization['achieved_gflops']:.2f} GFLOP/s at "
                     f"{utilization['gflop_per_token']} GFLOP/token = "
                     f"{_pct(utilization['compute_fraction'])} of measured peak.")
    if "bandwidth_fraction" in utilization:
        lines.append(f"Decode weight traffic: {utilization['achieved_gbs']:.2f} GB/s "
                     f"({utilization['bytes_per_step'] / 1e6:.0f} MB per step, 1 step per "
                     f"median ITL) = {_pct(utilization['bandwidth_fraction'])} of measured "
                     "bandwidth.")
    return ["", *lines] if lines else []


def _mode(result: dict) -> str:
    load = result["load"]
    if result["mode"] == "rate":
        cap = f", in-flight cap {load['concurrency']}" if load["concurrency"] else ""
        return f"open loop at {load['request_rate']} req/s (burstiness {load['burstiness']}{cap})"
    if result["mode"] == "trace":
        return "trace arrival times"
    return f"closed loop, concurrency {load['concurrency'] or 1}"


def _params(params: dict) -> str:
    return "(" + ", ".join(f"{k} {v}" for k, v in params.items()) + ")"


def _num(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def plot_cdfs(records: list[RequestRecord], path: Path, title: str) -> Path:
    """TTFT, TPOT, ITL and e2e empirical CDFs of the successful requests."""
    plt = _pyplot()
    done = [r for r in records if r.is_ok]
    series = {
        "TTFT": [v for r in done if (v := metrics.ttft_s(r)) is not None],
        "TPOT": [v for r in done if (v := metrics.tpot_s(r)) is not None],
        "ITL": [v for r in done for v in metrics.itls_s(r)],
        "e2e": [v for r in done if (v := metrics.e2e_s(r)) is not None],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        values = sorted(v * 1e3 for v in values)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of requests"
               if name != "ITL" else "fraction of gaps", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(plt, fig, path)


def plot_sweep(points: list[dict], path: Path, title: str) -> Path:
    """Throughput and TTFT against the offered request rate."""
    plt = _pyplot()
    rates = [p["request_rate"] for p in points]
    summaries = [p["summary"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(rates, [s["request_throughput"] for s in summaries], "o-", label="completed")
    axes[0].plot(rates, [s["goodput"] or 0 for s in summaries], "s--", label="goodput")
    axes[0].plot(rates, rates, ":", color="grey", label="offered")
    axes[0].set(title="request throughput", xlabel="request rate (req/s)", ylabel="req/s")
    axes[1].plot(rates, [s["output_throughput"] for s in summaries], "o-")
    axes[1].set(title="output throughput", xlabel="request rate (req/s)", ylabel="tokens/s")
    for pct in ("p50", "p99"):
        axes[2].plot(rates, [s["ttft_ms"][pct] or 0 for s in summaries], "o-", label=pct)
    axes[2].set(title="TTFT", xlabel="request rate (req/s)", ylabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[2].legend()
    fig.suptitle(title)
    return _save(plt, fig, path)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

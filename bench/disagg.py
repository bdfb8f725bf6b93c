"""`duplex bench disagg`: unified vs prefill/decode workers on mixed traffic, same cores.

Traffic (trace mode, the same for every configuration): short chats arriving at Poisson rate
`--short-rate`, plus a long prompt (`--long-input` tokens, ~4,000 by default) every
`--long-every-s` seconds. Each configuration is a fresh `duplex serve` on the same machine:

    unified-fifo     one unified worker (all threads), one FIFO, no prefill share, no budget
    unified-buckets  one unified worker, length buckets + fair prefill share + step time
                     budget (--step-budget-ms)
    1p1d-fifo        one prefill + one decode worker (threads split), one FIFO, no budget
    1p1d-buckets     one prefill + one decode worker, buckets + share + step time budget

Reported per configuration: TTFT p50/p99 of the short requests, TTFT of the long ones,
inter-token latency p50/p99 of streams while a long prompt is being prefilled (gaps that
overlap a long request's send..first-token window), output throughput, and each worker's
cost-model median relative step-time prediction error (from /metrics).

    from duplex.bench.disagg import run_configs
    results = run_configs(["unified-buckets", "1p1d-buckets"], duration_s=60)
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import urllib.request
from pathlib import Path

from duplex.bench import metrics
from duplex.bench.record import RequestRecord
from duplex.bench.runner import LoadConfig
from duplex.bench.serve import bench as run_bench
from duplex.bench.server_proc import free_port, running_server
from duplex.bench.workloads import Conversation, Turn, Workload

_FIFO = ["--length-buckets", "none", "--no-fair-prefill", "--step-budget-ms", "0"]
_SPLIT = ["--prefill-workers", "1", "--decode-workers", "1"]
CONFIGS = {  # the bucket configurations also get --step-budget-ms from the command line
    "unified-fifo": _FIFO,
    "unified-buckets": [],
    "1p1d-fifo": [*_SPLIT, *_FIFO],
    "1p1d-buckets": _SPLIT,
}


# ---------------------------------------------------------------- traffic
def mixed_workload(text, *, duration_s: float, short_rate: float, short_input: int,
                   short_output: int, long_input: int, long_output: int, long_every_s: float,
                   long_offset_s: float, seed: int) -> Workload:
    """Short chats at Poisson times plus a long prompt every long_every_s seconds."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(short_rate)
        if t >= duration_s:
            break
        arrivals.append((t, "short"))
    t = long_offset_s
    while t < duration_s:
        arrivals.append((t, "long"))
        t += long_every_s
    conversations = []
    for i, (at, kind) in enumerate(sorted(arrivals)):
        num_in, num_out = (short_input, short_output) if kind == "short" else \
            (long_input, long_output)
        message = {"role": "user", "content": text.text(num_in, rng).text}
        conversations.append(Conversation(i, (Turn((message,), num_out),), arrival_s=at,
                                          headers=(("x-bench-kind", kind),)))
    params = dict(duration_s=duration_s, short_rate=short_rate, short_input=short_input,
                  short_output=short_output, long_input=long_input, long_output=long_output,
                  long_every_s=long_every_s, seed=seed)
    return Workload("disagg-mixed", conversations, params)


def kinds(workload: Workload) -> dict[int, str]:
    return {c.conversation_id: dict(c.headers)["x-bench-kind"] for c in workload.conversations}


# ---------------------------------------------------------------- figures
def figures(records: list[RequestRecord], kind_of: dict[int, str], duration_s: float) -> dict:
    short = [r for r in records if kind_of[r.conversation_id] == "short" and r.is_ok]
    long = [r for r in records if kind_of[r.conversation_id] == "long" and r.is_ok]
    windows = [(r.send_s, r.send_s + metrics.ttft_s(r)) for r in long if r.chunk_s]
    during = []
    for r in records:
        if not r.is_ok or kind_of[r.conversation_id] == "long":
            continue
        times = [r.send_s + c for c in r.chunk_s]
        during += [b - a for a, b in zip(times, times[1:])
                   if any(a < end and b > start for start, end in windows)]
    tokens = sum(metrics.output_tokens(r) for r in records if r.is_ok)
    return {
        "num_short_ok": len(short), "num_long_ok": len(long),
        "num_failed": sum(1 for r in records if not r.is_ok),
        "short_ttft_ms": metrics.distribution_ms(
            [metrics.ttft_s(r) for r in short if r.chunk_s]),
        "long_ttft_ms": metrics.distribution_ms(
            [metrics.ttft_s(r) for r in long if r.chunk_s]),
        "itl_during_long_prefill_ms": metrics.distribution_ms(during),
        "itl_all_ms": metrics.distribution_ms(
            [gap for r in records if r.is_ok for gap in metrics.itls_s(r)]),
        "output_tokens_per_s": tokens / duration_s if duration_s else 0.0,
    }


def worker_figures(url: str) -> dict[str, dict[str, float]]:
    """Each worker's cost-model figures (coefficients, median relative prediction error,
    samples) and hand-off counters, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    figures: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _FIGURE.match(line)
        if match:
            labels = dict(_LABEL.findall(match.group(1)))
            figures.setdefault(labels["worker"], {})[labels["name"]] = float(match.group(2))
    return figures


_FIGURE = re.compile(r"duplex_worker_figure\{([^}]*)\} (\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


# ---------------------------------------------------------------- running
def run_config(name: str, workload: Workload, serve_args: list[str], *,
               max_duration_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_server(["serve", *serve_args, *CONFIGS[name]], port, timeout_s=600):
        load = LoadConfig(url=url, max_duration_s=max_duration_s, progress=False,
                          request_timeout_s=max_duration_s)
        result = run_bench(workload, load, label=name)
        workers = worker_figures(url)
    records = [RequestRecord.from_json(r) for r in result["records"]]
    errors = {w: f["cost_median_rel_error"] for w, f in workers.items()
              if "cost_median_rel_error" in f}
    return {"config": name, "serve_args": [*serve_args, *CONFIGS[name]],
            "duration_s": result["summary"].get("duration_s"),
            **figures(records, kinds(workload), result["summary"].get("duration_s") or 0.0),
            "cost_model_median_rel_error": errors, "workers": workers,
            "records": result["records"]}


def run_configs(names: list[str], *, model: str | None = None, serve_args: list[str] = (),
                max_duration_s: float = 900.0, tokenizer: str | None = None,
                **traffic) -> list[dict]:
    from duplex.bench.hf import load_tokenizer
    from duplex.bench.text import TextSource

    defaults = dict(duration_s=150.0, short_rate=0.2, short_input=64, short_output=32,
                    long_input=4000, long_output=16, long_every_s=70.0, long_offset_s=10.0,
                    seed=0)
    defaults.update(traffic)
    text = TextSource(load_tokenizer(tokenizer or model), seed=defaults["seed"])
    workload = mixed_workload(text, **defaults)
    args = [*(["--model", model] if model else []), *serve_args]
    return [run_config(name, workload, args, max_duration_s=max_duration_s) for name in names]


# ---------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--model", default=None, help="model path (default model)")
    parser.add_argument("--duration-s", type=float, default=150.0, help="arrivals span")
    parser.add_argument("--short-rate", type=float, default=0.2, help="short chats per second")
    parser.add_argument("--short-input", type=int, default=64, help="short message tokens")
    parser.add_argument("--short-output", type=int, default=32, help="short max_tokens")
    parser.add_argument("--long-input", type=int, default=4000, help="long prompt tokens")
    parser.add_argument("--long-output", type=int, default=16, help="long max_tokens")
    parser.add_argument("--long-every-s", type=float, default=70.0, help="long prompt period")
    parser.add_argument("--long-offset-s", type=float, default=10.0, help="first long at")
    parser.add_argument("--max-duration-s", type=float, default=900.0,
                        help="cut a configuration's run after this long")
    parser.add_argument("--step-budget-ms", type=float, default=1000.0,
                        help="step time budget of the bucket configurations (0: none)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="extra `duplex serve` argument (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/bench/disagg.json", help="result JSON")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"duplex bench disagg: unknown configs {unknown}", file=sys.stderr)
        return 2
    serve_args = ["--max-model-len", str(max(8192, args.long_input + 512)),
                  "--step-budget-ms", str(args.step_budget_ms), *args.serve_arg]
    results = run_configs(
        names, model=args.model, serve_args=serve_args, max_duration_s=args.max_duration_s,
        duration_s=args.duration_s, short_rate=args.short_rate, short_input=args.short_input,
        short_output=args.short_output, long_input=args.long_input,
        long_output=args.long_output, long_every_s=args.long_every_s,
        long_offset_s=args.long_offset_s, seed=args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    print(table(results))
    print(f"\nwritten: {out}")
    return 0


def table(results: list[dict]) -> str:
    def ms(dist: dict, q: str) -> str:
        value = dist.get(q) if dist else None
        return "-" if value is None else f"{value:.0f}"

    lines = ["| config | short TTFT p50 / p99 ms | long TTFT p50 ms | ITL during long "
             "prefill p50 / p99 ms | ITL all p50 / p99 ms | out tok/s | cost-model median "
             "rel. error | failed |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        errors = ", ".join(f"{w}: {e:.2f}" for w, e in sorted(
            r["cost_model_median_rel_error"].items())) or "-"
        lines.append(
            f"| {r['config']} | {ms(r['short_ttft_ms'], 'p50')} / "
            f"{ms(r['short_ttft_ms'], 'p99')} | {ms(r['long_ttft_ms'], 'p50')} | "
            f"{ms(r['itl_during_long_prefill_ms'], 'p50')} / "
            f"{ms(r['itl_during_long_prefill_ms'], 'p99')} | {ms(r['itl_all_ms'], 'p50')} / "
            f"{ms(r['itl_all_ms'], 'p99')} | {r['output_tokens_per_s']:.1f} | {errors} | "
            f"{r['num_failed']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="duplex.bench.disagg")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))

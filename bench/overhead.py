"""`duplex bench frontend-overhead`: how much of each token's time the frontend itself costs.

Starts `duplex serve` (default model), drives it with N concurrent streaming chats, and reads
the CPU seconds the frontend process and the engine worker spent during the run. The
frontend's CPU time per output token, against the measured TPOT and e2e latency, is the time
per token the frontend adds (it runs on its own core-share; any second of its CPU is a
second the engine could have used on this 2-core box).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra flag for duplex serve (repeatable)")
    parser.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    from duplex.bench.server_proc import children, cpu_seconds, free_port, running_server
    from duplex.bench.serve import run_workload

    port = free_port()
    with running_server(["serve", "--max-num-seqs", str(args.concurrency), *args.serve_arg],
                        port) as proc:
        workers = children(proc.pid)
        before = (cpu_seconds(proc.pid), sum(cpu_seconds(w) for w in workers))
        result = run_workload(f"http://127.0.0.1:{port}", "random", concurrency=args.concurrency,
                              num_requests=args.num_requests, input_len=args.input_len,
                              output_len=args.output_len, max_duration_s=1800,
                              progress=False)
        after = (cpu_seconds(proc.pid), sum(cpu_seconds(w) for w in workers))
    s = result["summary"]
    tokens = max(1, s["output_tokens"])
    frontend_ms = (after[0] - before[0]) * 1e3 / tokens
    worker_ms = (after[1] - before[1]) * 1e3 / tokens
    wall_ms_per_token = s["duration_s"] * 1e3 / tokens
    report = {
        "concurrency": args.concurrency, "completed": s["completed"], "failed": s["failed"],
        "output_tokens": s["output_tokens"], "output_throughput": s["output_throughput"],
        "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"],
        "frontend_cpu_ms_per_token": frontend_ms, "worker_cpu_ms_per_token": worker_ms,
        "frontend_share_of_cpu": frontend_ms / (frontend_ms + worker_ms),
        "frontend_share_of_wall": frontend_ms / wall_ms_per_token,
    }
    print(markdown(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if s["completed"] else 1


def markdown(r: dict) -> str:
    t, p = r["ttft_ms"], r["tpot_ms"]
    return "\n".join([
        f"| concurrency | completed | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
        "frontend CPU ms/token | worker CPU ms/token | frontend share of CPU | "
        "frontend share of wall time per token |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['concurrency']} | {r['completed']} | {r['output_throughput']:.1f} | "
        f"{t['p50']:.0f} / {t['p99']:.0f} | {p['p50']:.0f} / {p['p99']:.0f} | "
        f"{r['frontend_cpu_ms_per_token']:.2f} | {r['worker_cpu_ms_per_token']:.2f} | "
        f"{100 * r['frontend_share_of_cpu']:.1f} % | {100 * r['frontend_share_of_wall']:.1f} % |"])

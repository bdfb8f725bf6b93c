"""`duplex bench kv`: the KV cache hierarchy, measured through the server and offline.

  multi-turn  C conversations x T turns sharing a system prompt, through `duplex serve`:
              input-token hit rate, prefill tokens computed, TTFT p50 of turn >= 2 vs turn 1.
  mooncake    replay of the Mooncake conversation trace (16 tokens per hash block; the first
              N sessions with 3+ requests) against a small device pool + RAM tier, then the
              same with the SSD tier added.
  ttft        cold vs device / host / disk-hit time to first token of a 2,000-token prompt
              (offline, `bench.kv_tiers`).
  disk        the SSD tier's read MB/s next to plain file reads (`bench.kv_disk`).
  fleet       2 prefill + 1 decode workers on the Mooncake trace: per-worker SSD tiers vs
              one shared tier (Redis, shared directory) vs the trace's bound (`bench.kv_fleet`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

PARTS = ("multi-turn", "mooncake", "ttft", "disk", "fleet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", action="append", choices=PARTS,
                        help="which measurement(s) to run (default: all)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256,
                        help="multi-turn: tokens of each new user turn")
    parser.add_argument("--system-len", type=int, default=512,
                        help="multi-turn: tokens of the shared system prompt")
    parser.add_argument("--mooncake-requests", type=int, default=300)
    parser.add_argument("--mooncake-sessions", type=int, default=40,
                        help="replay the trace's first N multi-request sessions (0: the "
                             "first --mooncake-requests lines in order)")
    parser.add_argument("--mooncake-time-scale", type=float, default=0.02,
                        help="trace time compression (0.02: 50x faster than recorded)")
    parser.add_argument("--small-pool-blocks", type=int, default=256)
    parser.add_argument("--host-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--ttft-tokens", type=int, default=2000)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra flag for duplex serve in the multi-turn run (repeatable)")
    parser.add_argument("--fleet-layout", action="append", default=None,
                        choices=("per-worker-disk", "shared-redis", "shared-dir"),
                        help="fleet: which tier layout(s) to run (default: all three)")
    parser.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    parts = args.part or list(PARTS)
    report = {}
    for part in parts:
        report[part] = {"multi-turn": multi_turn, "mooncake": mooncake, "ttft": ttft,
                        "disk": disk, "fleet": fleet}[part](args)
        print(f"## {part}\n{json.dumps(report[part], indent=2)}\n", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def _serve_and_run(serve_args: list[str], workload: str, **options) -> dict:
    from duplex.bench.server_proc import free_port, running_server
    from duplex.bench.serve import run_workload

    port = free_port()
    with running_server(["serve", *serve_args], port):
        return run_workload(f"http://127.0.0.1:{port}", workload, progress=False,
                            max_duration_s=3600, **options)


def _by_turn(result: dict) -> dict:
    from duplex.bench.metrics import ttft_s
    from duplex.bench.record import RequestRecord

    records = [RequestRecord.from_json(r) for r in result["records"]]
    first = [ttft_s(r) for r in records if r.is_ok and r.turn == 0]
    later = [ttft_s(r) for r in records if r.is_ok and r.turn >= 1]
    return {"ttft_p50_turn1_ms": 1e3 * statistics.median(first) if first else None,
            "ttft_p50_later_turns_ms": 1e3 * statistics.median(later) if later else None}


def multi_turn(args) -> dict:
    result = _serve_and_run(args.serve_arg, "multi-turn", num_conversations=args.conversations,
                            num_turns=args.turns, concurrency=args.concurrency,
                            output_len=args.output_len, input_len=args.input_len,
                            system_len=args.system_len)
    s = result["summary"]
    out = {"completed": s["completed"], "failed": s["failed"],
           "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
           "hit_rate": s["cache_hit_rate"],
           "prefill_tokens_computed": s["prompt_tokens"] - s["cached_tokens"]}
    out["hit_rate_bound"] = _hit_rate_bound(args)
    out.update(_by_turn(result))
    if out["ttft_p50_turn1_ms"] and out["ttft_p50_later_turns_ms"]:
        out["ttft_turn1_over_later"] = out["ttft_p50_turn1_ms"] / out["ttft_p50_later_turns_ms"]
    return out


def _hit_rate_bound(args) -> float:
    """The best input-token hit rate the multi-turn workload allows: every turn can reuse all
    earlier turns of its conversation (and the first, the shared system prompt), but never
    its own new user turn. Chat-template tokens and block rounding are left out."""
    prompt = cached = 0
    for turn in range(args.turns):
        history = args.system_len + turn * (args.input_len + args.output_len)
        prompt += args.conversations * (history + args.input_len)
        cached += args.conversations * history - (args.system_len if turn == 0 else 0)
    return cached / prompt


def mooncake(args) -> dict:
    out = {}
    base = ["--num-kv-blocks", str(args.small_pool_blocks), "--kv-host-bytes",
            str(args.host_bytes)]
    with tempfile.TemporaryDirectory(prefix="duplex-bench-kv-") as kv_dir:
        for label, extra in (("device+ram", []), ("device+ram+ssd", ["--kv-dir", kv_dir])):
            result = _serve_and_run(base + extra, "mooncake", max_requests=args.mooncake_requests,
                                    time_scale=args.mooncake_time_scale, output_scale=0.05,
                                    sessions=args.mooncake_sessions,
                                    concurrency=args.concurrency)
            s = result["summary"]
            out[label] = {"completed": s["completed"], "failed": s["failed"],
                          "rejected": s["rejected"], "prompt_tokens": s["prompt_tokens"],
                          "cached_tokens": s["cached_tokens"], "hit_rate": s["cache_hit_rate"],
                          "ttft_p50_ms": s["ttft_ms"].get("p50")}
    return out


def ttft(args) -> dict:
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import EngineCore
    from duplex.bench.kv_tiers import bench_cached_ttft

    def factory(**fields):
        return EngineCore(EngineConfig.of(**fields), progress=False)

    return bench_cached_ttft(factory, num_tokens=args.ttft_tokens)


def fleet(args) -> dict:
    from duplex.bench.kv_fleet import fleet as run_fleet

    return run_fleet(args)


def disk(args) -> dict:
    from duplex.bench.kv_disk import measure_read_mb_s

    with tempfile.TemporaryDirectory(prefix="duplex-bench-disk-") as root:
        # one SmolLM2 block of 16 tokens: 30 layers x 2 x 16 x 3 heads x 64 x 4 bytes
        return measure_read_mb_s(root, block_bytes=737280, num_blocks=256)

"""`duplex bench kv --part fleet`: a fleet of 2 prefill workers + 1 decode worker replaying
the Mooncake conversation trace, once per KV tier layout:

  per-worker-disk  each worker its own SSD tier (`--kv-dir DIR/{worker}`)
  shared-redis     one Redis for the fleet (`--kv-remote redis://...`; a private
                   redis-server the benchmark starts on a free loopback port)
  shared-dir       one shared directory for the fleet (`--kv-remote DIR`)

and the bound the trace allows: the input-token hit rate if every block any earlier request
had were cached everywhere (counted in trace hash blocks, before chat-template tokens).
Each layout gets a small device pool and no RAM tier, so hits beyond the pool must come
from the tier under test. Reports hit rate and TTFT p50 / p99 per layout.
"""
from __future__ import annotations

import collections
import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

LAYOUTS = ("per-worker-disk", "shared-redis", "shared-dir")


def fleet(args) -> dict:
    out = {"bound": trace_bound(args)}
    for layout in getattr(args, "fleet_layout", None) or LAYOUTS:
        with tempfile.TemporaryDirectory(prefix="duplex-bench-fleet-") as tmp, \
                _tier_flags(layout, Path(tmp)) as flags:
            out[layout] = _replay(args, flags)
    return out


def _replay(args, tier_flags: list[str]) -> dict:
    from duplex.bench.serve import run_workload
    from duplex.bench.server_proc import free_port, running_server

    serve = ["serve", "--prefill-workers", "2", "--decode-workers", "1",
             "--num-kv-blocks", str(args.small_pool_blocks), *tier_flags, *args.serve_arg]
    port = free_port()
    with running_server(serve, port):
        result = run_workload(f"http://127.0.0.1:{port}", "mooncake", progress=False,
                              max_duration_s=3600, max_requests=args.mooncake_requests,
                              time_scale=args.mooncake_time_scale, output_scale=0.05,
                              sessions=args.mooncake_sessions, concurrency=args.concurrency)
        tiers = _kv_tiers(port)
    s = result["summary"]
    errors = collections.Counter(f"{r.get('error')}: {(r.get('detail') or '')[:120]}"
                                 for r in result["records"] if r.get("error"))
    return {"completed": s["completed"], "failed": s["failed"], "rejected": s["rejected"],
            "errors": dict(errors),
            "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
            "hit_rate": s["cache_hit_rate"], "ttft_p50_ms": s["ttft_ms"].get("p50"),
            "ttft_p99_ms": s["ttft_ms"].get("p99"), "kv_tiers": tiers}


def _kv_tiers(port: int) -> dict:
    """/v1/status `kv_tiers` at the end of the run (summed over the workers)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=10) as reply:
        return json.load(reply).get("kv_tiers", {})


@contextlib.contextmanager
def _tier_flags(layout: str, tmp: Path):
    if layout == "per-worker-disk":
        yield ["--kv-dir", str(tmp / "{worker}")]
    elif layout == "shared-dir":
        yield ["--kv-remote", str(tmp / "shared")]
    else:
        with _redis(tmp) as url:
            yield ["--kv-remote", url]


@contextlib.contextmanager
def _redis(workdir: Path):
    from duplex.bench.server_proc import free_port

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir),
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def trace_bound(args) -> float:
    """Best input hit rate of the replayed slice: each request reuses the leading hash
    blocks that any earlier request had (prefix-closed, so a chain), never its new ones."""
    from duplex.bench.workloads import (_CONTEXT_MARGIN, WorkloadOptions, default_trace_path,
                                 read_trace, select_sessions)

    options = WorkloadOptions()
    entries = read_trace(default_trace_path(), None if args.mooncake_sessions else
                         args.mooncake_requests)
    if args.mooncake_sessions:
        entries = select_sessions(entries, args.mooncake_sessions)[:args.mooncake_requests]
    max_blocks = max((options.max_model_len - _CONTEXT_MARGIN - 1) // options.tokens_per_block, 1)
    return hash_bound(entries, max_blocks)


def hash_bound(entries: list[dict], max_blocks: int) -> float:
    """Hit rate in hash blocks if each request reused every leading block seen before."""
    seen: set[tuple[int, ...]] = set()
    total = cached = 0
    for entry in entries:
        ids = tuple(entry["hash_ids"][:max_blocks])
        total += len(ids)
        cached += next((n for n in range(len(ids), 0, -1) if ids[:n] in seen), 0)
        seen.update(ids[:n] for n in range(1, len(ids) + 1))
    return cached / total if total else 0.0

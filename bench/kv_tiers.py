"""Micro-benchmark: time to first token of one long prompt, cold vs a prefix hit in each tier.

    python -m duplex.bench.kv_tiers [--num-tokens 2000] [--model PATH]   (or `duplex bench kv --part ttft`)

Runs, in one KV directory: cold (computes and writes every block behind to disk), device hit
(the same prompt again), host hit (device blocks evicted into host RAM first), and disk hit
(a restarted core without a host tier, device blocks evicted first; the block files are
dropped from the page cache, so the reads reach the disk itself). Every core is warmed up
first; hit cases report the median of `repeats` runs (`disk_first_s`: the restarted core's
first run, which also pays its first long-context forward).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams

_FIRST_TOKEN = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)


def bench_cached_ttft(core_factory: Callable[..., object], num_tokens: int = 2000,
                      repeats: int = 3, seed: int = 0) -> dict[str, float]:
    """Median TTFT in seconds per case (cold runs once), the hit tokens per tier of the
    last run of each case, and speed-ups over cold.

    `core_factory(**config_fields)` builds an EngineCore; it is given `kv_dir` and
    `kv_host_bytes`."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 20000) for _ in range(num_tokens)]
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="duplex-kv-bench-") as kv_dir:
        tiers = dict(kv_dir=kv_dir, kv_host_bytes=4 * num_tokens * 64 * 1024)
        core = _started(core_factory, tiers, warm_up_tokens=520)  # one full prefill chunk too
        _record(result, "cold", [_ttft(core, prompt, "cold")])
        _record(result, "device", [_ttft(core, prompt, f"device-{i}") for i in range(repeats)])
        _record(result, "host", [_evicted_ttft(core, prompt, f"host-{i}")
                                 for i in range(repeats)])
        core.close()
        core = _started(core_factory, dict(tiers, kv_host_bytes=0))  # a restart, disk only
        runs = [_disk_ttft(core, kv_dir, prompt, f"disk-{i}") for i in range(repeats)]
        core.close()
        result["disk_first_s"] = runs[0][0]  # the restarted core's first long context
        _record(result, "disk", runs)
    for case in ("device", "host", "disk"):
        result[f"{case}_speedup"] = result["cold_s"] / result[f"{case}_s"]
    return result


def _started(core_factory, config_fields: dict, warm_up_tokens: int = 64):
    """A core whose first steps are behind it: a prompt cold, then as a prefix hit, so no
    measured case pays the one-time costs of new shapes."""
    core = core_factory(**config_fields)
    warm_up = list(range(100, 100 + warm_up_tokens))
    for i in range(2):
        _ttft(core, warm_up, f"warm-up-{i}")
    return core


def _evicted_ttft(core, prompt: list[int], req_id: str):
    core.kv.drop_cached()  # every cached device block goes to host RAM
    return _ttft(core, prompt, req_id)


def _disk_ttft(core, kv_dir: str, prompt: list[int], req_id: str):
    """With no host tier, evicted device blocks live only on disk; their files are also
    dropped from the page cache, so the reads reach the disk itself."""
    core.kv.drop_cached()
    _drop_page_cache(kv_dir)
    return _ttft(core, prompt, req_id)


def _ttft(core, prompt: list[int], req_id: str) -> tuple[float, dict[str, int]]:
    start = time.perf_counter()
    core.add_request(AddRequest(req_id, prompt, _FIRST_TOKEN))
    while True:
        for delta in core.step():
            if delta.req_id == req_id and delta.new_token_ids:
                elapsed = time.perf_counter() - start
                while core.has_unfinished_requests():
                    core.step()
                return elapsed, delta.cached_tokens_by_tier


def _record(result: dict, case: str, runs: list[tuple[float, dict[str, int]]]) -> None:
    result[f"{case}_s"] = statistics.median(seconds for seconds, _ in runs)
    for tier, num in runs[-1][1].items():
        result[f"{case}_hit_{tier}"] = float(num)


def _drop_page_cache(root: str) -> None:
    """Ask the kernel to forget the (clean, fsynced) block files' pages."""
    for path in Path(root).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duplex.bench.kv_tiers",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import EngineCore

    def factory(**fields):
        return EngineCore(EngineConfig.of(model=args.model, **fields), progress=False)

    print(json.dumps(bench_cached_ttft(factory, args.num_tokens, args.repeats), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The shared KV tier in the operations endpoints: per-worker figures in /metrics, the
tier in /v1/status, and shared-tier tokens in the per-tier cached-token counter."""
from __future__ import annotations

from engine.messages import WorkerStats
from frontend_fakes import FakeEngineClient
from test_ops import HI, samples

SHARED = {"kv_shared_on": 1.0, "kv_shared_hits": 4.0, "kv_shared_read_p99_ms": 2.5,
          "kv_shared_read_errors": 1.0, "kv_hit_tokens_shared": 64.0}


async def test_shared_tier_figures_per_worker_in_metrics_and_usage(make_harness):
    engine = FakeEngineClient(num_cached=16, cached_by_tier={"shared": 16})
    engine.worker_stats = lambda: {"prefill-0": WorkerStats(extra=SHARED),
                                   "prefill-1": WorkerStats(extra={"kv_shared_on": 0.0})}
    h = await make_harness(engine)
    await h.post("/v1/chat/completions", {"messages": HI})
    m = samples(await (await h.client.get("/metrics")).text())
    figure = lambda worker, name: m[("duplex_worker_figure",  # noqa: E731
                                     (("name", name), ("worker", worker)))]
    assert figure("prefill-0", "kv_shared_on") == 1 and figure("prefill-1", "kv_shared_on") == 0
    assert figure("prefill-0", "kv_shared_read_p99_ms") == 2.5
    assert figure("prefill-0", "kv_shared_read_errors") == 1
    assert figure("prefill-0", "kv_hit_tokens_shared") == 64
    assert m[("duplex_cached_prompt_tokens_total", (("tier", "shared"),))] == 16


async def test_status_lists_the_shared_tier_per_worker(make_harness):
    engine = FakeEngineClient()
    engine.worker_stats = lambda: {
        "prefill-0": WorkerStats(extra={**SHARED, "kv_shared_store_bytes": 4096.0}),
        "prefill-1": WorkerStats(extra={"kv_shared_on": 0.0, "kv_shared_store_bytes": 0.0}),
        "decode-0": WorkerStats(extra={})}
    h = await make_harness(engine)
    shared = (await (await h.client.get("/v1/status")).json())["kv_tiers"]["shared"]
    assert shared["bytes"] == 4096.0, "one store: its size, not a sum over workers"
    assert set(shared["workers"]) == {"prefill-0", "prefill-1"}
    assert shared["workers"]["prefill-0"]["read_p99_ms"] == 2.5
    assert shared["workers"]["prefill-1"] == {"on": 0.0, "store_bytes": 0.0}

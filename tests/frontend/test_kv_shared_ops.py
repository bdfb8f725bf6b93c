"""The shared KV tier in the operations endpoints: per-worker figures in /metrics, the
tier in /v1/status, and shared-tier tokens in the per-tier cached-token counter."""
from __future__ import annotations

from duplex.engine.messages import WorkerStats
from duplex.engine.stats import KVStats, KVTierStats, SharedTierStats
from frontend_fakes import FakeEngineClient
from test_ops import HI, samples

SHARED = SharedTierStats(on=1.0, hits=4.0, read_p99_ms=2.5, read_errors=1.0)
OFF = SharedTierStats(on=0.0)


def _stats(shared: SharedTierStats | None, hit_tokens: float = 0.0) -> WorkerStats:
    return WorkerStats(kv=KVStats(shared=KVTierStats(hit_tokens=hit_tokens), shared_tier=shared))


def _figures(shared: SharedTierStats) -> dict[str, float]:
    """Every field by name: the tier reports all of them, zeros included."""
    return {name: float(getattr(shared, name)) for name in SharedTierStats.__struct_fields__}


async def test_shared_tier_figures_per_worker_in_metrics_and_usage(make_harness):
    engine = FakeEngineClient(num_cached=16, cached_by_tier={"shared": 16})
    engine.worker_stats = lambda: {"prefill-0": _stats(SHARED, hit_tokens=64.0),
                                   "prefill-1": _stats(OFF)}
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
    prefill_1 = SharedTierStats(on=0.0, store_bytes=0.0)
    engine.worker_stats = lambda: {
        "prefill-0": _stats(SharedTierStats(on=1.0, hits=4.0, read_p99_ms=2.5, read_errors=1.0,
                                            store_bytes=4096.0)),
        "prefill-1": _stats(prefill_1),
        "decode-0": WorkerStats()}
    h = await make_harness(engine)
    shared = (await (await h.client.get("/v1/status")).json())["kv_tiers"]["shared"]
    assert shared["bytes"] == 4096.0, "one store: its size, not a sum over workers"
    assert set(shared["workers"]) == {"prefill-0", "prefill-1"}
    assert shared["workers"]["prefill-0"]["read_p99_ms"] == 2.5
    assert shared["workers"]["prefill-1"] == _figures(prefill_1)

"""Prometheus metrics of the frontend, in a registry of its own (served at GET /metrics).

Request-level figures (latencies, tokens, speculation) are observed by the generation
pipeline as events pass; engine-level figures (queue length, running requests, KV blocks,
layout, preemptions) are copied from the worker's latest stats when /metrics or /v1/status
is read.

`render(model_name)` labels every sample with `model_name` (as vLLM does) and repeats the
families whose meaning is the same as a vLLM metric under vLLM's name (VLLM_NAMES), so
dashboards built for vLLM can be pointed at Duplex. docs/metrics.md has the mapping.
"""
from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from duplex.engine.messages import Ready, WorkerStats
from duplex.engine.stats import MoEStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
THROUGHPUT_WINDOW_S = 10

# Duplex family -> the vLLM family of the same meaning (names without _total / _bucket).
VLLM_NAMES = {
    "duplex_requests_running": "vllm:num_requests_running",
    "duplex_requests_waiting": "vllm:num_requests_waiting",
    "duplex_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # a 0..1 fraction in both
    "duplex_prompt_tokens": "vllm:prompt_tokens",
    "duplex_generation_tokens": "vllm:generation_tokens",
    "duplex_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "duplex_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "duplex_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "duplex_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "duplex_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "duplex_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "duplex_request_inference_time_seconds": "vllm:request_inference_time_seconds",
    "duplex_request_prompt_tokens": "vllm:request_prompt_tokens",
    "duplex_request_generation_tokens": "vllm:request_generation_tokens",
    "duplex_num_preemptions": "vllm:num_preemptions",
    "duplex_prefix_cache_queries": "vllm:prefix_cache_queries",
    "duplex_prefix_cache_hits": "vllm:prefix_cache_hits",
    "duplex_spec_draft_proposed_tokens": "vllm:spec_decode_num_draft_tokens",
    "duplex_spec_draft_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._add_request_metrics(r)
        self._add_latency_metrics(r)
        self._add_token_metrics(r)
        self._add_engine_metrics(r)
        self._window: collections.deque[list[int]] = collections.deque()  # [second, tokens]
        self.num_draft_proposed = 0  # totals for /v1/status (counters are write-only)
        self.num_draft_accepted = 0
        self.num_preemptions = 0  # the workers' own total, copied from their stats
        r.register(_WorkerCounters(self))

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Requests by endpoint, refusals, finish reasons; in flight, running, waiting."""
        self.requests = Counter("duplex_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("duplex_requests_rejected", "Requests refused before running",
                                ["reason"], registry=r)
        self.finished = Counter("duplex_request_finished", "Finished choices by finish reason",
                                ["finish_reason"], registry=r)
        self.in_flight = Gauge("duplex_frontend_requests_in_flight",
                               "Requests admitted by the frontend and not finished", registry=r)
        self.running = Gauge("duplex_requests_running", "Requests running on the workers",
                             registry=r)
        self.waiting = Gauge("duplex_requests_waiting", "Queue length: requests waiting on "
                             "the workers", registry=r)

    def _add_latency_metrics(self, r: CollectorRegistry) -> None:
        """Per-request latencies and their phases."""
        self.ttft = Histogram("duplex_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("duplex_time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("duplex_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("duplex_request_queue_time_seconds", "Time a request waited "
                                    "in the worker before it was first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("duplex_request_prefill_time_seconds", "First scheduled "
                                      "to first token (prefill, cache hits included)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("duplex_request_decode_time_seconds", "First token to the "
                                     "last (decode)", buckets=_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("duplex_request_inference_time_seconds", "First "
                                        "scheduled to the end (prefill + decode)",
                                        buckets=_LATENCY_BUCKETS, registry=r)

    def _add_token_metrics(self, r: CollectorRegistry) -> None:
        """Tokens: per request, totals, cache hits, drafts."""
        self.request_prompt_tokens = Histogram("duplex_request_prompt_tokens", "Prompt tokens "
                                               "per request", buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "duplex_request_generation_tokens", "Generated tokens per request",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.prefix_cache_queries = Counter("duplex_prefix_cache_queries", "Prompt tokens "
                                            "looked up in the KV cache", registry=r)
        self.prefix_cache_hits = Counter("duplex_prefix_cache_hits", "Prompt tokens found in "
                                         "the KV cache, any tier", registry=r)
        self.prompt_tokens = Counter("duplex_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("duplex_generation_tokens", "Generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("duplex_cached_prompt_tokens",
                                     "Prompt tokens served from the KV cache, by tier",
                                     ["tier"], registry=r)
        self.draft_proposed = Counter("duplex_spec_draft_proposed_tokens",
                                      "Speculative draft tokens proposed", registry=r)
        self.draft_accepted = Counter("duplex_spec_draft_accepted_tokens",
                                      "Speculative draft tokens accepted", registry=r)

    def _add_engine_metrics(self, r: CollectorRegistry) -> None:
        """The engine: KV pool, mode, workers, per-worker figures, MoE."""
        self.kv_blocks_used = Gauge("duplex_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_blocks_total = Gauge("duplex_kv_blocks_total", "KV blocks in the pool",
                                     registry=r)
        self.kv_usage = Gauge("duplex_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                              registry=r)
        self.batch_invariant = Gauge("duplex_batch_invariant",
                                     "1 when the engine runs batch-invariant", registry=r)
        self.workers = Gauge("duplex_workers", "Engine workers by role (the layout)", ["role"],
                             registry=r)
        self.engine_ready = Gauge("duplex_engine_ready", "1 when a worker is ready", registry=r)
        self.worker_figures = Gauge(
            "duplex_worker_figure", "Per-worker figures: cost-model coefficients (cost_*), "
            "median relative step-time prediction error, KV hand-offs (handoff_*, intake_*), "
            "prompt tokens served per KV tier (kv_hit_tokens_*), the shared KV tier "
            "(kv_shared_*: on, hits, misses, bytes, read latency, errors)",
            ["worker", "name"], registry=r)
        self.moe_rank_load = Gauge(
            "duplex_moe_rank_load_tokens", "MoE: (token, expert) pairs each expert-parallel "
            "rank computed over the statistics window, summed over MoE layers",
            ["worker", "rank"], registry=r)
        self.moe_imbalance = Gauge(
            "duplex_moe_imbalance", "MoE: max / mean rank load (1.0 = balanced), mean or max "
            "over MoE layers", ["worker", "over_layers"], registry=r)
        self.moe_rebalances = Gauge("duplex_moe_rebalances", "MoE: expert placements switched "
                                    "in by the load balancer", ["worker"], registry=r)

    # ------------------------------------------------------------ observed per request
    def observe_delta(self, num_tokens: int, num_proposed: int, num_accepted: int) -> None:
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
            self._count_window(num_tokens)
        if num_proposed:
            self.draft_proposed.inc(num_proposed)
            self.draft_accepted.inc(num_accepted)
            self.num_draft_proposed += num_proposed
            self.num_draft_accepted += num_accepted

    def observe_final(self, final) -> None:
        """Latencies and prompt-side counts of one finished choice (generation.Final)."""
        usage, timings = final.usage, final.timings
        self.finished.labels(final.finish_reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.e2e.observe(timings.e2e_s)
        if usage.completion_tokens:
            self.ttft.observe(timings.ttft_s)
        if usage.completion_tokens > 1:
            decode_s = timings.e2e_s - timings.ttft_s
            self.tpot.observe(decode_s / (usage.completion_tokens - 1))
        self._observe_phases(timings, usage.completion_tokens)
        self.request_prompt_tokens.observe(usage.prompt_tokens)
        self.request_generation_tokens.observe(usage.completion_tokens)
        self.prefix_cache_queries.inc(usage.prompt_tokens)
        self.prefix_cache_hits.inc(usage.cached_tokens)
        for tier, num in _cached_by_tier(usage.cached_tokens, usage.cached_by_tier).items():
            self.cached_tokens.labels(tier).inc(num)

    def _observe_phases(self, timings, num_tokens: int) -> None:
        """Queue / prefill / decode split of one request (only once it was scheduled)."""
        queue_s = timings.queue_s
        if not queue_s:
            return
        self.queue_time.observe(queue_s)
        self.inference_time.observe(max(0.0, timings.e2e_s - queue_s))
        if num_tokens:
            self.prefill_time.observe(max(0.0, timings.ttft_s - queue_s))
            self.decode_time.observe(max(0.0, timings.e2e_s - timings.ttft_s))

    def throughput(self) -> float:
        """Generated tokens per second over the last THROUGHPUT_WINDOW_S seconds."""
        self._trim(int(time.monotonic()))
        return sum(n for _, n in self._window) / THROUGHPUT_WINDOW_S

    # ------------------------------------------------------------ copied from the engine
    def update_engine(self, stats: WorkerStats | None, ready: Ready | None,
                      is_ready: bool, layout: dict[str, int]) -> None:
        self.engine_ready.set(1 if is_ready else 0)
        for role, num_workers in layout.items():
            self.workers.labels(role).set(num_workers)
        if ready is not None:
            self.batch_invariant.set(1 if ready.batch_invariant else 0)
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_blocks_used.set(stats.num_kv_blocks_used)
            self.kv_blocks_total.set(stats.num_kv_blocks_total)
            self.kv_usage.set(kv_usage(stats))
            self.num_preemptions = stats.num_preemptions

    def update_workers(self, worker_stats: dict[str, WorkerStats]) -> None:
        for worker_id, stats in worker_stats.items():
            for name, value in worker_figures(stats).items():
                self.worker_figures.labels(worker_id, name).set(value)
            if stats.moe is not None:
                self._update_moe(worker_id, stats.moe)

    def _update_moe(self, worker_id: str, moe: MoEStats) -> None:
        for rank, num_tokens in enumerate(moe.rank_tokens):
            self.moe_rank_load.labels(worker_id, str(rank)).set(num_tokens)
        self.moe_imbalance.labels(worker_id, "mean").set(moe.imbalance_mean)
        self.moe_imbalance.labels(worker_id, "max").set(moe.imbalance_max)
        self.moe_rebalances.labels(worker_id).set(moe.rebalances)

    def render(self, model_name: str | None = None) -> bytes:
        """Prometheus text: every sample labelled model_name, vLLM's names repeated."""
        if model_name is None:
            return generate_latest(self.registry)
        return generate_latest(_Labelled(self.registry, model_name))

    def _count_window(self, num_tokens: int) -> None:
        second = int(time.monotonic())
        if self._window and self._window[-1][0] == second:
            self._window[-1][1] += num_tokens
        else:
            self._window.append([second, num_tokens])
            self._trim(second)

    def _trim(self, second: int) -> None:
        while self._window and self._window[0][0] <= second - THROUGHPUT_WINDOW_S:
            self._window.popleft()


class _WorkerCounters:
    """Counters the workers keep (their totals arrive with their stats): preemptions."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        family = CounterMetricFamily("duplex_num_preemptions", "Requests preempted (KV freed, "
                                     "recomputed later) by the workers since they started")
        family.add_metric([], self.metrics.num_preemptions)
        yield family


class _Labelled:
    """A view of a registry with a `model_name` label on every sample, and each family in
    VLLM_NAMES once more under vLLM's name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**s.labels, "model_name": self.model_name})
                              for s in family.samples]
            yield family
            alias = VLLM_NAMES.get(family.name)
            if alias is not None:
                yield _renamed(family, alias)


def _renamed(family, name: str):
    copy = type(family).__new__(type(family))
    copy.__dict__.update(family.__dict__)
    copy.name = name
    copy.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return copy


def worker_figures(stats: WorkerStats) -> dict[str, float]:
    """One worker's `duplex_worker_figure` samples, by name: cost-model coefficients
    (cost_*), KV hand-off (handoff_*, intake_*, num_rejected_kv_frames), prompt tokens
    served per KV tier (kv_hit_tokens_*), the fleet-shared tier (kv_shared_*)."""
    out: dict[str, float] = {}
    if stats.cost is not None:
        out.update(stats.cost.figures("cost_"))
    if stats.handoff is not None:
        out.update(stats.handoff.figures("handoff_"))
    if stats.intake is not None:
        intake = stats.intake.figures("intake_")
        out["num_rejected_kv_frames"] = intake.pop("intake_rejected_kv_frames")
        out.update(intake)
    if stats.kv is not None:
        out.update({f"kv_hit_tokens_{name}": tier.hit_tokens
                    for name, tier in stats.kv.tiers.items()})
        if stats.kv.shared_tier is not None:
            out.update(stats.kv.shared_tier.figures("kv_shared_"))
    return out


def kv_usage(stats: WorkerStats) -> float:
    total = stats.num_kv_blocks_total
    return stats.num_kv_blocks_used / total if total else 0.0


def _cached_by_tier(num_cached: int, by_tier: dict[str, int]) -> dict[str, int]:
    """Tiers as reported; tokens the worker did not attribute count as device hits."""
    tiers = {tier: num for tier, num in by_tier.items() if num > 0}
    rest = num_cached - sum(tiers.values())
    if rest > 0:
        tiers["device"] = tiers.get("device", 0) + rest
    return tiers

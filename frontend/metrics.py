"""Prometheus metrics of the frontend, in a registry of its own (served at GET /metrics).

Request-level figures (latencies, tokens, speculation) are observed by the generation
pipeline as events pass; engine-level figures (queue length, running requests, KV blocks,
layout) are copied from the worker's latest stats when /metrics or /v1/status is read.
"""
from __future__ import annotations

import collections
import re
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.messages import Ready, WorkerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
THROUGHPUT_WINDOW_S = 10


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
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
        self.ttft = Histogram("duplex_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("duplex_time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("duplex_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
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
        self._window: collections.deque[list[int]] = collections.deque()  # [second, tokens]
        self.num_draft_proposed = 0  # totals for /v1/status (counters are write-only)
        self.num_draft_accepted = 0

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
        for tier, num in _cached_by_tier(usage.cached_tokens, usage.cached_by_tier).items():
            self.cached_tokens.labels(tier).inc(num)

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

    def update_workers(self, worker_stats: dict[str, WorkerStats]) -> None:
        for worker_id, stats in worker_stats.items():
            for name, value in stats.extra.items():
                if name.startswith(_WORKER_FIGURES):
                    self.worker_figures.labels(worker_id, name).set(value)
                elif match := _MOE_RANK.fullmatch(name):
                    self.moe_rank_load.labels(worker_id, match.group(1)).set(value)
                elif name in ("moe_imbalance_mean", "moe_imbalance_max"):
                    self.moe_imbalance.labels(worker_id, name.rsplit("_", 1)[1]).set(value)
                elif name == "moe_rebalances":
                    self.moe_rebalances.labels(worker_id).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

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


_MOE_RANK = re.compile(r"moe_rank(\d+)_tokens")
_WORKER_FIGURES = ("cost_", "handoff_", "intake_", "num_rejected_kv_frames",
                   "kv_hit_tokens_", "kv_shared_")  # kv_shared_*: the fleet-shared tier


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

"""WorkerStats.merge: counts summed, rates re-derived from their summed parts, coefficients
weighted by their samples, quantiles as upper bounds; the wire round trip keeps every field."""
from __future__ import annotations

import msgspec
import pytest

from duplex.engine.messages import Heartbeat
from duplex.engine.stats import (CalibrationBin, CostStats, HeadStats, KVStats, KVTierStats,
                          MoEStats, SharedTierStats, SpecStats, WorkerStats)
from duplex.frontend.metrics import worker_figures


def _worker(queried: float, device_hits: float, host_hits: float, samples: float,
            step_s: float, p99: float) -> WorkerStats:
    kv = KVStats(queried_tokens=queried, device=KVTierStats(hit_tokens=device_hits),
                 host=KVTierStats(hit_tokens=host_hits, bytes=100.0),
                 shared_tier=SharedTierStats(on=1.0, hits=2.0, read_p99_ms=p99,
                                             store_bytes=4096.0))
    return WorkerStats(num_running=1, num_prompt_tokens=int(queried), kv=kv,
                       cost=CostStats(step_s=step_s, num_samples=samples))


def test_counts_add_and_rates_are_reweighted():
    a = _worker(queried=100, device_hits=50, host_hits=0, samples=10, step_s=1.0, p99=2.0)
    b = _worker(queried=300, device_hits=0, host_hits=30, samples=30, step_s=3.0, p99=9.0)
    merged = WorkerStats.merge([a, b])
    assert (merged.num_running, merged.num_prompt_tokens) == (2, 400)
    assert merged.kv.hit_rate == (50 + 30) / 400  # not 0.5 + 0.1
    assert (merged.kv.device.hit_tokens, merged.kv.host.bytes) == (50, 200)
    assert merged.cost.step_s == pytest.approx((1.0 * 10 + 3.0 * 30) / 40)
    assert merged.cost.num_samples == 40
    shared = merged.kv.shared_tier
    assert (shared.hits, shared.read_p99_ms, shared.store_bytes, shared.on) == (4, 9.0, 4096, 1)


def test_missing_parts_merge_to_what_the_others_have():
    with_spec = WorkerStats(spec=SpecStats(num_draft_proposed=4, num_draft_accepted=3,
                                           num_rounds=2, num_emitted=5,
                                           proposed_by_position=[2, 2]))
    merged = WorkerStats.merge([with_spec, WorkerStats(moe=MoEStats(rank_tokens=[1.0, 2.0]))])
    assert merged.spec == with_spec.spec and merged.moe.rank_tokens == [1.0, 2.0]
    assert (merged.kv, merged.cost, merged.grammar) == (None, None, None)
    assert merged.spec.acceptance_rate == 0.75 and merged.spec.mean_acceptance_length == 2.5
    assert WorkerStats.merge([]) is None


def test_spec_positions_add_and_calibration_bins_are_weighted_by_count():
    a = SpecStats(proposed_by_position=[4.0, 2.0], head=HeadStats(
        num=10, log_loss=0.2, bins=[CalibrationBin(low=0.5, count=1, observed=1.0)]))
    b = SpecStats(proposed_by_position=[6.0], head=HeadStats(
        num=30, log_loss=0.6, bins=[CalibrationBin(low=0.5, count=3, observed=0.0),
                                    CalibrationBin(low=0.9, count=2, observed=0.5)]))
    merged = SpecStats.merge([a, b])
    assert merged.proposed_by_position == [10.0, 2.0]
    assert merged.head.log_loss == pytest.approx(0.5) and merged.head.num == 40
    assert merged.head.bins == [CalibrationBin(low=0.5, count=4, observed=0.25),
                                CalibrationBin(low=0.9, count=2, observed=0.5)]


def test_heartbeat_round_trip_keeps_the_typed_stats():
    stats = _worker(queried=10, device_hits=5, host_hits=1, samples=3, step_s=0.5, p99=1.0)
    beat = Heartbeat("w0", stats)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(beat), type=Heartbeat) == beat


def test_worker_figures_keep_the_metric_names():
    stats = _worker(queried=10, device_hits=5, host_hits=1, samples=3, step_s=0.5, p99=1.0)
    figures = worker_figures(stats)
    assert figures["cost_step_s"] == 0.5 and figures["cost_num_samples"] == 3
    assert figures["kv_hit_tokens_device"] == 5 and figures["kv_hit_tokens_host"] == 1
    assert figures["kv_shared_read_p99_ms"] == 1.0 and figures["kv_shared_on"] == 1
    assert not any(name.startswith(("handoff_", "intake_")) for name in figures)

"""Metric definitions on synthetic timelines with known answers."""
from __future__ import annotations

import pytest

from duplex.bench import metrics
from duplex.bench.metrics import Slo
from duplex.bench.record import CANCELLED, FAILED, OK, REJECTED, RequestRecord


def make_record(chunk_s=(0.1, 0.15, 0.25, 0.3), end_s=0.4, status=OK, **fields) -> RequestRecord:
    return RequestRecord(request_id=fields.pop("request_id", 0), conversation_id=0, turn=0,
                         chunk_s=list(chunk_s), end_s=end_s, status=status, **fields)


def test_per_request_metrics_follow_the_standard_definitions():
    record = make_record(completion_tokens=4)
    assert metrics.ttft_s(record) == 0.1
    assert metrics.e2e_s(record) == 0.4
    assert metrics.itls_s(record) == pytest.approx([0.05, 0.1, 0.05])
    assert metrics.tpot_s(record) == pytest.approx((0.4 - 0.1) / 3)


def test_output_tokens_come_from_usage_else_from_chunks():
    assert metrics.output_tokens(make_record(completion_tokens=7)) == 7
    assert metrics.output_tokens(make_record()) == 4
    # Speculation: fewer chunks than tokens; TPOT uses tokens, ITL uses chunk gaps.
    record = make_record(chunk_s=(0.1, 0.3), end_s=0.3, completion_tokens=5)
    assert metrics.tpot_s(record) == pytest.approx(0.2 / 4)
    assert metrics.itls_s(record) == pytest.approx([0.2])


def test_tpot_is_undefined_for_one_token_and_ttft_for_no_tokens():
    assert metrics.tpot_s(make_record(chunk_s=(0.1,), end_s=0.1, completion_tokens=1)) is None
    assert metrics.ttft_s(make_record(chunk_s=(), end_s=0.2)) is None


def test_distribution_uses_linear_percentiles_in_ms():
    d = metrics.distribution_ms([v / 1000 for v in range(1, 101)])
    assert d["count"] == 100
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert metrics.distribution_ms([]) == {"count": 0, "mean": None, "p50": None, "p90": None,
                                           "p99": None}


def test_slo_checks_ttft_and_tpot():
    record = make_record(completion_tokens=4)           # TTFT 100 ms, TPOT 100 ms
    assert metrics.meets_slo(record, Slo(ttft_ms=100.001, tpot_ms=100.001))
    assert not metrics.meets_slo(record, Slo(ttft_ms=99))
    assert not metrics.meets_slo(record, Slo(tpot_ms=99))
    one_token = make_record(chunk_s=(0.05,), end_s=0.05, completion_tokens=1)
    assert metrics.meets_slo(one_token, Slo(ttft_ms=60, tpot_ms=1))
    assert not metrics.meets_slo(make_record(status=FAILED), Slo(ttft_ms=1e9))


def test_summary_counts_rates_cache_and_speculation():
    fast = make_record(request_id=0, completion_tokens=4, prompt_tokens=100, cached_tokens=75,
                       draft_proposed=10, draft_accepted=6)
    slow = make_record(request_id=1, chunk_s=(1.0, 1.5), end_s=2.0, completion_tokens=3,
                       prompt_tokens=300, cached_tokens=0, draft_proposed=10, draft_accepted=2)
    failed = make_record(request_id=2, chunk_s=(), end_s=0.1, status=FAILED, error="HTTP 500")
    failed2 = make_record(request_id=3, chunk_s=(), end_s=0.1, status=FAILED, error="HTTP 500")
    rejected = make_record(request_id=4, chunk_s=(), end_s=0.01, status=REJECTED,
                           error="HTTP 429")
    cancelled = make_record(request_id=5, chunk_s=(0.5,), end_s=9.0, status=CANCELLED)
    s = metrics.summarize([fast, slow, failed, failed2, rejected, cancelled], duration_s=10.0,
                          num_planned=8, slo=Slo(ttft_ms=500))
    assert (s["completed"], s["failed"], s["rejected"], s["cancelled"], s["not_sent"]) == \
        (2, 2, 1, 1, 2)
    assert s["failure_reasons"] == {"HTTP 500": 2}
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["output_throughput"] == pytest.approx(0.7)
    assert s["total_token_throughput"] == pytest.approx(40.7)
    assert s["goodput"] == pytest.approx(0.1)            # only `fast` has TTFT <= 500 ms
    assert s["cache_hit_rate"] == pytest.approx(75 / 400)
    assert s["spec_acceptance"] == pytest.approx(8 / 20)
    assert s["ttft_ms"]["count"] == 2 and s["ttft_ms"]["mean"] == pytest.approx(550)
    assert s["itl_ms"]["count"] == 4                     # 3 gaps + 1 gap, failures excluded
    assert s["e2e_ms"]["p50"] == pytest.approx(1200)


def test_summary_without_usage_or_slo_reports_none():
    s = metrics.summarize([make_record()], duration_s=1.0)
    assert s["cache_hit_rate"] is None
    assert s["spec_acceptance"] is None
    assert s["goodput"] is None
    assert s["output_tokens"] == 4


def test_record_json_round_trip():
    record = make_record(completion_tokens=4, error=None, text="hi")
    assert RequestRecord.from_json(record.to_json() | {"unknown": 1}) == record

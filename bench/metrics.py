"""Serving metrics: pure functions from request timelines to numbers (standard definitions).

* TTFT: send → first streamed content chunk.
* TPOT: (e2e − TTFT) / (output tokens − 1), for requests with at least two output tokens.
* ITL: every gap between consecutive content chunks (a chunk may carry several tokens).
* e2e: send → end of stream.
* Throughput: completed requests and output tokens per second of run duration.
* Goodput: completed requests per second that meet every SLO given.
* Cache hit rate: sum of cached prompt tokens / sum of prompt tokens, from usage.
* Speculative acceptance: accepted / proposed draft tokens, when the server reports them.

Latency distributions are reported in milliseconds as mean / p50 / p90 / p99.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, NamedTuple

import numpy as np

from duplex.bench.record import CANCELLED, FAILED, REJECTED, RequestRecord

PERCENTILES = (50, 90, 99)


class Slo(NamedTuple):
    """Latency limits a request must meet to count towards goodput (None = no limit)."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def ttft_s(record: RequestRecord) -> float | None:
    return record.chunk_s[0] if record.chunk_s else None


def e2e_s(record: RequestRecord) -> float | None:
    return record.end_s


def itls_s(record: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(record.chunk_s, record.chunk_s[1:])]


def output_tokens(record: RequestRecord) -> int:
    """Tokens generated: from usage when the server reports it, else one per content chunk."""
    if record.completion_tokens is not None:
        return record.completion_tokens
    return len(record.chunk_s)


def tpot_s(record: RequestRecord) -> float | None:
    num_tokens, ttft, e2e = output_tokens(record), ttft_s(record), e2e_s(record)
    if num_tokens < 2 or ttft is None or e2e is None:
        return None
    return (e2e - ttft) / (num_tokens - 1)


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """A request with one output token has no TPOT and cannot miss a TPOT limit."""
    if not record.is_ok:
        return False
    ttft, tpot = ttft_s(record), tpot_s(record)
    if slo.ttft_ms is not None and (ttft is None or ttft * 1e3 > slo.ttft_ms):
        return False
    return slo.tpot_ms is None or tpot is None or tpot * 1e3 <= slo.tpot_ms


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | int | None]:
    """mean / p50 / p90 / p99 (linear interpolation) in ms; None when there are no values."""
    values = np.asarray(list(values_s), dtype=np.float64) * 1e3
    result: dict[str, float | int | None] = {"count": int(values.size)}
    if values.size == 0:
        return result | {"mean": None} | {f"p{p}": None for p in PERCENTILES}
    result["mean"] = float(values.mean())
    for p in PERCENTILES:
        result[f"p{p}"] = float(np.percentile(values, p))
    return result


def cache_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    reported = [r for r in records if r.prompt_tokens and r.cached_tokens is not None]
    num_prompt = sum(r.prompt_tokens for r in reported)
    return sum(r.cached_tokens for r in reported) / num_prompt if num_prompt else None


def spec_acceptance(records: Iterable[RequestRecord]) -> float | None:
    reported = [r for r in records if r.draft_proposed]
    num_proposed = sum(r.draft_proposed for r in reported)
    return sum(r.draft_accepted or 0 for r in reported) / num_proposed if num_proposed else None


def summarize(records: list[RequestRecord], duration_s: float, num_planned: int | None = None,
              slo: Slo = Slo()) -> dict:
    """Everything a report shows, from the records of one run lasting `duration_s`."""
    done = [r for r in records if r.is_ok]
    num_output = sum(output_tokens(r) for r in done)
    num_prompt = sum(r.prompt_tokens or 0 for r in done)
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    num_planned = len(records) if num_planned is None else num_planned
    return {
        "duration_s": duration_s,
        "num_planned": num_planned,
        "num_sent": len(records),
        "completed": len(done),
        "failed": _count(records, FAILED),
        "rejected": _count(records, REJECTED),
        "cancelled": _count(records, CANCELLED),
        "not_sent": max(num_planned - len(records), 0),
        "failure_reasons": dict(Counter(r.error for r in records if r.status == FAILED)),
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "cached_tokens": sum(r.cached_tokens or 0 for r in done),
        "request_throughput": rate(len(done)),
        "output_throughput": rate(num_output),
        "total_token_throughput": rate(num_output + num_prompt),
        "goodput": rate(sum(meets_slo(r, slo) for r in done)) if slo.is_set else None,
        "slo": slo._asdict(),
        "ttft_ms": distribution_ms(v for r in done if (v := ttft_s(r)) is not None),
        "tpot_ms": distribution_ms(v for r in done if (v := tpot_s(r)) is not None),
        "itl_ms": distribution_ms(v for r in done for v in itls_s(r)),
        "e2e_ms": distribution_ms(v for r in done if (v := e2e_s(r)) is not None),
        "cache_hit_rate": cache_hit_rate(done),
        "spec_acceptance": spec_acceptance(done),
        "draft_proposed": sum(r.draft_proposed or 0 for r in done),
        "draft_accepted": sum(r.draft_accepted or 0 for r in done),
    }


def _count(records: list[RequestRecord], status: str) -> int:
    return sum(r.status == status for r in records)

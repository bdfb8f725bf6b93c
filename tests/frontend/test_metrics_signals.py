"""GET /metrics parsed with prometheus_client's own parser: every sample carries model_name,
vLLM's names repeat the families of the same meaning, and the queue / prefill / decode
histograms, preemptions, KV hits per tier and speculation counters move under load."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
from frontend_fakes import FakeEngineClient
from prometheus_client.parser import text_string_to_metric_families

from duplex.frontend.metrics import VLLM_NAMES

QUEUE_S = 0.03
NUM_REQUESTS = 6
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


class QueuedEngine(FakeEngineClient):
    """The fake engine, with its worker's queue time and preemption total on the deltas."""

    async def _deltas(self, msg):
        async for delta in super()._deltas(msg):
            yield msgspec.structs.replace(delta, queue_s=QUEUE_S)

    def stats(self):
        return msgspec.structs.replace(super().stats(), num_preemptions=3)


async def scrape(h) -> dict:
    response = await h.client.get("/metrics")
    assert response.status == 200
    return {f.name: f for f in text_string_to_metric_families(await response.text())}


def value(families, name, suffix="", **labels) -> float:
    family = families[name]
    matches = [s.value for s in family.samples if s.name == name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, suffix, labels, family.samples)
    return matches[0]


async def test_labels_vllm_names_and_histograms_move(make_harness):
    engine = QueuedEngine(reply="Hello there!", step_s=0.002, num_cached=5,
                          cached_by_tier={"device": 3, "disk": 2}, draft=(4, 3))
    h = await make_harness(engine, served_model_names=("smol-test",))
    before = await scrape(h)
    assert value(before, "duplex_request_queue_time_seconds", "_count") == 0

    responses = await asyncio.gather(*(h.post("/v1/chat/completions", CHAT)
                                       for _ in range(NUM_REQUESTS)))
    assert all(r.status == 200 for r in responses)
    after = await scrape(h)

    for family in after.values():  # every sample of every family names the model
        assert all(s.labels.get("model_name") == "smol-test" for s in family.samples), family.name
    for duplex_name, vllm_name in VLLM_NAMES.items():
        assert duplex_name in after and vllm_name in after, (duplex_name, vllm_name)
        assert after[vllm_name].type == after[duplex_name].type
    n = NUM_REQUESTS
    for name in ("duplex_request_queue_time_seconds", "duplex_request_prefill_time_seconds",
                 "duplex_request_decode_time_seconds", "duplex_request_inference_time_seconds",
                 "vllm:request_queue_time_seconds", "duplex_time_to_first_token_seconds"):
        assert value(after, name, "_count") == n, name
    assert value(after, "duplex_request_queue_time_seconds", "_sum") == \
        pytest.approx(n * QUEUE_S)
    assert value(after, "vllm:request_queue_time_seconds", "_bucket", le="0.05") == n
    assert value(after, "vllm:request_queue_time_seconds", "_bucket", le="0.025") == 0
    assert value(after, "duplex_request_generation_tokens", "_sum") == n * 5
    assert value(after, "vllm:num_preemptions", "_total") == 3
    assert value(after, "duplex_cached_prompt_tokens", "_total", tier="disk") == n * 2
    assert value(after, "duplex_cached_prompt_tokens", "_total", tier="device") == n * 3
    assert value(after, "vllm:prefix_cache_hits", "_total") == n * 5
    prompt = value(after, "vllm:prompt_tokens", "_total")
    assert prompt > 0 and value(after, "vllm:prefix_cache_queries", "_total") == prompt
    assert value(after, "vllm:spec_decode_num_draft_tokens", "_total") == n * 5 * 4
    assert value(after, "vllm:spec_decode_num_accepted_tokens", "_total") == n * 5 * 3
    assert value(after, "vllm:num_requests_running") == 0


def test_grafana_dashboard_queries_only_metrics_duplex_exports():
    import json
    import re
    from pathlib import Path

    from duplex.frontend.metrics import Metrics

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana"
                            / "duplex-dashboard.json").read_text())
    exported = {f.name for f in text_string_to_metric_families(
        Metrics().render("m").decode())}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    used = {re.sub(r"_(bucket|total)$", "", name) for e in exprs
            for name in re.findall(r"\b((?:vllm:|duplex_)[a-z0-9_:]+)", e)}
    assert len(used) >= 15 and used <= exported, sorted(used - exported)

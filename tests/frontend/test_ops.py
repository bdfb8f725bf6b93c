"""Operations endpoints: /metrics, /v1/status, /health, /openapi.json, the web UI."""
from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from duplex.engine.stats import KVStats, KVTierStats, MoEStats, SharedTierStats
from duplex.frontend.openapi import ENDPOINTS
from duplex.frontend.server import AppState, ServerOptions
from frontend_fakes import FakeEngineClient, FakeRecipe

HI = [{"role": "user", "content": "hi"}]


def samples(text: str, model_name: str = "fake-model") -> dict[tuple, float]:
    """{(name, labels other than model_name): value}; every sample names the model."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == model_name, s
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_parse_and_count(make_harness):
    h = await make_harness(FakeEngineClient(num_cached=5, cached_by_tier={"disk": 2},
                                            draft=(2, 1), batch_invariant=True))
    await h.post("/v1/chat/completions", {"messages": HI})
    await h.post("/v1/chat/completions", {"messages": []})
    response = await h.client.get("/metrics")
    assert response.status == 200 and response.content_type == "text/plain"
    m = samples(await response.text())
    n = len("Hello there, friend!")
    endpoint = (("endpoint", "/v1/chat/completions"),)
    assert m[("duplex_requests_total", endpoint + (("status", "200"),))] == 1
    assert m[("duplex_requests_total", endpoint + (("status", "400"),))] == 1
    assert m[("duplex_generation_tokens_total", ())] == n
    assert m[("duplex_prompt_tokens_total", ())] == len("<user>hi\n<assistant>")
    assert m[("duplex_cached_prompt_tokens_total", (("tier", "disk"),))] == 2
    assert m[("duplex_cached_prompt_tokens_total", (("tier", "device"),))] == 3
    num_deltas = n + 1  # the fake reports drafts on the final (EOS) delta too
    assert m[("duplex_spec_draft_proposed_tokens_total", ())] == 2 * num_deltas
    assert m[("duplex_spec_draft_accepted_tokens_total", ())] == num_deltas
    assert m[("duplex_time_to_first_token_seconds_count", ())] == 1
    assert m[("duplex_time_per_output_token_seconds_count", ())] == 1
    assert m[("duplex_e2e_request_latency_seconds_count", ())] == 1
    assert m[("duplex_batch_invariant", ())] == 1
    assert m[("duplex_workers", (("role", "unified"),))] == 1
    assert m[("duplex_kv_blocks_total", ())] == 64
    assert m[("duplex_requests_waiting", ())] == 0
    assert m[("duplex_requests_running", ())] == 0
    assert m[("duplex_request_finished_total", (("finish_reason", "stop"),))] == 1


async def test_unknown_paths_do_not_create_metric_labels(harness):
    for i in range(5):
        await harness.client.get(f"/v1/random-{i}")
    text = await (await harness.client.get("/metrics")).text()
    assert "random" not in text


async def test_status(make_harness):
    h = await make_harness(FakeEngineClient(draft=(4, 3)))
    await h.post("/v1/chat/completions", {"messages": HI, "max_tokens": 3})
    status = await (await h.client.get("/v1/status")).json()
    assert status["status"] == "ok" and status["model"] == "fake-model"
    assert (status["running"], status["waiting"], status["in_flight"]) == (0, 0, 0)
    assert status["kv_usage"] == 0.0 and status["kv_blocks_total"] == 64
    assert status["hit_rate"] == 0.25
    assert status["throughput_tokens_per_s"] > 0
    assert status["layout"] == {"unified": 1}
    assert status["batch_invariant"] is False
    assert (status["num_threads"], status["weights"]) == (2, "float32")  # from the worker's Ready
    assert status["speculation"] == {"mode": "off", "per_request": True, "draft_proposed": 12,
                                     "draft_accepted": 9, "acceptance_rate": 0.75}
    assert status["kv_tiers"]["disk"] == {"bytes": 0.0, "hit_tokens": 0.0}
    assert status["moe"] is None  # a dense model


async def test_status_per_tier_kv_and_expert_load(make_harness):
    engine = FakeEngineClient()
    shared_tier = SharedTierStats(on=1.0, read_p50_ms=0.4)
    kv = KVStats(device=KVTierStats(bytes=4096.0, hit_tokens=32.0),
                 host=KVTierStats(bytes=2048.0), disk=KVTierStats(bytes=8192.0, hit_tokens=16.0),
                 shared=KVTierStats(hit_tokens=48.0), shared_tier=shared_tier)
    moe = MoEStats(rank_tokens=[30.0, 10.0], ep_ranks=2.0, imbalance_mean=1.4,
                   imbalance_max=1.5, rebalances=3.0)
    base = engine.stats()
    engine.stats = lambda: msgspec.structs.replace(base, kv=kv, moe=moe)
    h = await make_harness(engine)
    status = await (await h.client.get("/v1/status")).json()
    assert status["kv_tiers"] == {"device": {"bytes": 4096.0, "hit_tokens": 32.0},
                                  "host": {"bytes": 2048.0, "hit_tokens": 0.0},
                                  "disk": {"bytes": 8192.0, "hit_tokens": 16.0},
                                  "shared": {"bytes": 0.0, "hit_tokens": 48.0, "workers": {
                                      "worker": shared_tier.figures()}}}
    assert status["kv_tiers"]["shared"]["workers"]["worker"]["read_p50_ms"] == 0.4
    assert status["moe"] == {"ep_ranks": 2, "rank_load_tokens": [30.0, 10.0],
                             "imbalance_mean": 1.4, "imbalance_max": 1.5, "rebalances": 3}


async def test_openapi_is_complete_and_self_consistent(harness):
    spec = await (await harness.client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.")
    schemas = spec["components"]["schemas"]
    for endpoint in ENDPOINTS:
        operation = spec["paths"][endpoint.path][endpoint.method]
        assert "200" in operation["responses"]
        if endpoint.request is not None:
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] == endpoint.request.__name__
    for ref in _refs(spec):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    assert set(schemas["ChatMessage"]["properties"]["role"]["enum"]) == {
        "system", "developer", "user", "assistant", "tool"}
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    ws = spec["paths"]["/v1/ws"]["get"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in ws["x-server-frames"]["anyOf"]} == {
        "WsDelta", "WsDone", "WsError", "WsPong"}


async def test_web_ui_served_from_web_dir(make_harness, tmp_path):
    (tmp_path / "index.html").write_text("<h1>duplex</h1>")
    (tmp_path / "app.js").write_text("console.log(1)")
    (tmp_path.parent / "secret.txt").write_text("nope")
    h = await make_harness(web_dir=tmp_path)
    assert await (await h.client.get("/")).text() == "<h1>duplex</h1>"
    assert await (await h.client.get("/app.js")).text() == "console.log(1)"
    for path in ("/../secret.txt", "/%2e%2e/secret.txt", "/missing.js"):
        assert (await h.client.get(path)).status == 404


async def test_root_without_web_dir(make_harness, tmp_path):
    h = await make_harness(web_dir=tmp_path / "none")
    body = await (await h.client.get("/")).json()
    assert body["openapi"] == "/openapi.json"


def test_server_options_are_validated():
    for bad in ({"max_queued_requests": 0}, {"max_n": 0}, {"request_timeout_s": -1}):
        try:
            ServerOptions(**bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
    assert AppState(FakeEngineClient(), FakeRecipe(), ServerOptions()).model_name == "fake-model"


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)

"""What every API handler shares: `AppState` (engine client, recipe, pipeline, metrics,
admission, the intake), and the protocols the server needs of its engine, recipe and options.

A leaf of the frontend's API layer: the handlers (openai_api, anthropic_api, responses_api,
ws) and the intake import it; it imports none of them and nothing of `server` (which
assembles the app and re-exports `AppState` for `serve` and the tests).

Admission lives in `frontend/admission.py`: `AppState` builds its one `Admission` from the
options (the request count, draining, the not-ready refusal, the work bound and the fair
gate); the intake asks it for a ticket per API request and the pipeline is handed the
ticket's reservation. Here it is only read (`admission.draining`, `admission.num_active`).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path
from typing import AsyncIterator, Protocol

from duplex.engine.messages import AddRequest, Ready, RequestDelta, WorkerStats
from duplex.engine.stats import KVStats, MoEStats
from duplex.engine.text.messages import Chat
from duplex.engine.text.tool_formats import detect_tool_format
from duplex.frontend.admission import Admission, not_ready
from duplex.frontend.auth import ApiKeys
from duplex.frontend.errors import ApiError
from duplex.frontend.generation import Pipeline, reasoning_format
from duplex.frontend.intake import Intake
from duplex.frontend.metrics import Metrics, kv_usage
from duplex.frontend.offload import CpuPool, longest_token_chars


class Options(Protocol):
    """What the app needs of its options: `server.ServerOptions` (a frozen dataclass,
    validated at construction)."""
    served_model_names: tuple[str, ...]
    max_queued_requests: int
    max_queued_sequences: int
    max_queued_prompt_tokens: int
    max_running_sequences: int
    max_n: int
    request_timeout_s: float
    api_keys: tuple[str, ...]
    metrics_public: bool
    client_max_size: int
    web_dir: Path | None
    allowed_origins: tuple[str, ...]
    chat_template: str | None
    tool_call_parser: str | None
    allow_request_chat_template: bool
    reasoning_parser: str | None


class Engine(Protocol):
    """What the server needs of its engine: `frontend.engine_client.EngineClient` (fakes in
    tests implement the same)."""
    ready: bool  # a worker is ready
    ready_info: Ready | None  # a live worker's Ready (the latest known if none)

    def generate(self, msg: AddRequest) -> AsyncIterator[RequestDelta]: ...
    def stats(self) -> WorkerStats | None: ...  # summed over the live workers
    def worker_stats(self) -> dict[str, WorkerStats]: ...  # each live worker's own
    def workers(self) -> dict[str, Ready]: ...  # the live workers


class TextRecipe(Protocol):
    """What the server needs of its recipe: `engine.text.recipe.Recipe` (fakes in tests
    implement the same)."""
    eos_token_ids: list[int]
    vocab_size: int  # token ids run below it
    template: str | None  # the model's chat template
    tokenizer: object | None  # None: no vocabulary to measure token lengths with (fakes)

    def encode_chat(self, chat: Chat, add_generation_prompt=True, template=None,
                    continue_final_message=False) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def encode_completion(self, text: str) -> list[int]: ...
    def encode_reply_start(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def new_detokenizer(self, skip_special_tokens: bool = True): ...


class AppState:
    """What every handler shares. The engine client and recipe are built by `serve`
    (or fakes in tests); everything else is derived from them here."""

    def __init__(self, engine: Engine, recipe: TextRecipe, options: Options,
                 metrics: Metrics | None = None, supervisor=None) -> None:
        self.engine = engine
        self.recipe = recipe
        self.supervisor = supervisor  # frontend.supervisor.Supervisor, None in tests
        if options.tool_call_parser is None:  # the format the served template writes
            options = dataclasses.replace(options, tool_call_parser=detect_tool_format(
                options.chat_template or recipe.template) or "hermes")
        self.options = options
        self.metrics = metrics or Metrics()
        # the one owner of admission: every refusal, the work bound, the fair gate
        self.admission = Admission.from_options(options, self.metrics,
                                                is_ready=lambda: bool(engine.ready))
        self.reasoning = reasoning_format(options, recipe)
        self.pipeline = Pipeline(engine, recipe, self.metrics,
                                 request_timeout_s=options.request_timeout_s,
                                 reasoning=self.reasoning)
        self.keys = ApiKeys(list(options.api_keys), options.metrics_public)
        self.started = int(time.time())
        # big bodies: read in steps, decoded, rendered and tokenized off the loop
        self.cpu = CpuPool(max_body_bytes=options.client_max_size)
        self.max_token_chars = longest_token_chars(recipe)
        self.intake = Intake(self)  # the one path from an API's request to the pipeline

    # ------------------------------------------------------------ readiness
    @property
    def is_ready(self) -> bool:
        return bool(self.engine.ready) and not self.admission.draining

    # ------------------------------------------------------------ model facts
    @property
    def model_name(self) -> str:
        if self.options.served_model_names:
            return self.options.served_model_names[0]
        info = self.engine.ready_info
        return info.model_name if info is not None else "duplex"

    @property
    def max_model_len(self) -> int:
        info = self.engine.ready_info
        if info is None:  # the worker went away after admission: the same refusal
            raise not_ready()
        return info.max_model_len

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.recipe.eos_token_ids)

    def check_model(self, name: str | None) -> None:
        info = self.engine.ready_info
        known = set(self.options.served_model_names) | {self.model_name}
        if info is not None:
            known.add(info.model_name)
        if name is not None and name not in known:
            raise ApiError("not_found", f"the model {name!r} does not exist; this server "
                           f"serves {self.model_name!r}", param="model", code="model_not_found")

    # ------------------------------------------------------------ what /v1/status reports
    def refresh_metrics(self) -> None:
        """Copy the engine's latest stats and the worker layout into the gauges."""
        self.metrics.update_engine(self.engine.stats(), self.engine.ready_info,
                                   bool(self.engine.ready), self.layout())
        self.metrics.update_workers(self.engine.worker_stats())

    def status(self) -> dict:
        self.refresh_metrics()
        info, stats = self.engine.ready_info, self.engine.stats()
        proposed = self.metrics.num_draft_proposed
        accepted = self.metrics.num_draft_accepted
        return {
            "status": self.health_status(),
            "model": self.model_name,
            "max_model_len": info.max_model_len if info else None,
            "running": stats.num_running if stats else 0,
            "waiting": stats.num_waiting if stats else 0,
            "in_flight": self.admission.num_active,
            "kv_usage": kv_usage(stats) if stats else 0.0,
            "kv_blocks_used": stats.num_kv_blocks_used if stats else 0,
            "kv_blocks_total": stats.num_kv_blocks_total if stats else 0,
            "hit_rate": (stats.num_cached_prompt_tokens / stats.num_prompt_tokens
                         if stats and stats.num_prompt_tokens else 0.0),
            "throughput_tokens_per_s": self.metrics.throughput(),
            "layout": self.layout(),
            "workers": self.workers(),
            "batch_invariant": bool(info and info.batch_invariant),
            "num_threads": info.num_threads if info else 0,
            "weights": info.weights if info else "",
            "speculation": {"mode": info.speculation if info else "off", "per_request": True,
                            "draft_proposed": proposed, "draft_accepted": accepted,
                            "acceptance_rate": accepted / proposed if proposed else 0.0},
            "kv_tiers": _kv_tiers(stats and stats.kv, self.engine.worker_stats()),
            "moe": _moe(stats and stats.moe),
        }

    def layout(self) -> dict[str, int]:
        """Worker processes by role, e.g. {"unified": 1} or {"prefill": 2, "decode": 1}."""
        if self.supervisor is not None:
            return dict(collections.Counter(w.role for w in self.supervisor.status()))
        info = self.engine.ready_info
        return {info.role: 1} if info else {}

    def workers(self) -> list[dict]:
        if self.supervisor is None:
            return []
        return [{"id": w.worker_id, "role": w.role, "state": w.state, "pid": w.pid,
                 "restarts": w.num_restarts, "last_exit": w.last_exit}
                for w in self.supervisor.status()]

    def health_status(self) -> str:
        """ok; degraded: serving, but a worker is down (its streams were recomputed or
        failed, the supervisor restarts it); unavailable: no worker; draining."""
        if self.admission.draining:
            return "draining"
        if not self.engine.ready:
            return "unavailable"
        num_ready, num_total = self.num_workers()
        return "degraded" if num_ready < num_total else "ok"

    def num_workers(self) -> tuple[int, int]:
        """(workers alive and announced, worker slots); (1, 1) without a supervisor."""
        if self.supervisor is None:
            return 1, 1
        return len(self.engine.workers()), len(self.supervisor.status())


def _kv_tiers(kv: KVStats | None, per_worker: dict[str, WorkerStats]) -> dict:
    """Bytes held and prompt tokens served per KV tier (device pool, host RAM, SSD, the
    fleet-shared store), summed over workers; the shared tier adds each worker's own
    figures (on, hits, misses, bytes, read latency, errors, store size)."""
    kv = kv or KVStats()
    tiers = {name: {"bytes": tier.bytes, "hit_tokens": tier.hit_tokens}
             for name, tier in kv.tiers.items()}
    workers = {worker_id: stats.kv.shared_tier.figures()
               for worker_id, stats in per_worker.items()
               if stats.kv is not None and stats.kv.shared_tier is not None}
    if not workers and kv.shared_tier is not None:  # one worker and no per-worker view
        workers = {"worker": kv.shared_tier.figures()}
    tiers["shared"]["bytes"] = max((f["store_bytes"] for f in workers.values()),
                                   default=0.0)  # one store: every worker sees its size
    tiers["shared"]["workers"] = workers
    return tiers


def _moe(moe: MoEStats | None) -> dict | None:
    """Expert load of a mixture-of-experts model (None for dense models)."""
    if moe is None or not moe.rank_tokens:
        return None
    return {"ep_ranks": int(moe.ep_ranks), "rank_load_tokens": moe.rank_tokens,
            "imbalance_mean": moe.imbalance_mean, "imbalance_max": moe.imbalance_max,
            "rebalances": int(moe.rebalances)}

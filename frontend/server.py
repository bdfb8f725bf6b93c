"""The aiohttp application: shared request state, admission, errors, and the ops endpoints.

`AppState` owns what every API handler shares (engine client, recipe, pipeline, metrics,
admission); `build_app` assembles the OpenAI, Anthropic and WebSocket routes with
/health, /v1/status, /metrics, /openapi.json and the web UI. One middleware checks API
keys, renders every error in the calling API's shape, counts requests and logs them.

Admission is bounded: past `max_queued_requests` requests in flight (running or waiting
anywhere) a request is refused at once with 429/529 and Retry-After; while draining, or
while no worker is ready, with 503.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Protocol

from aiohttp import web

from duplex.engine.logs import REQUEST_ID
from duplex.engine.messages import AddRequest, Ready, RequestDelta, WorkerStats
from duplex.engine.stats import KVStats, MoEStats
from duplex.engine.text.messages import Chat
from duplex.engine.text.reasoning import check_parser_name
from duplex.engine.text.tool_formats import TOOL_FORMATS, detect_tool_format
from duplex.engine.text.tool_parser import forced_call_prefix, tools_supported
from duplex.frontend import anthropic_api, openai_api, openapi, ws
from duplex.frontend.admission import WorkAdmission
from duplex.frontend.auth import ApiKeys
from duplex.frontend.cors import setup_cors
from duplex.frontend.errors import ApiError, invalid
from duplex.frontend.generation import Pipeline, reasoning_format
from duplex.frontend.metrics import Metrics, kv_usage
from duplex.frontend.offload import (CPU_POOL, CpuPool, check_prompt_chars, longest_token_chars,
                              text_chars)
from duplex.frontend.protocol import REQ_ID, json_response

log = logging.getLogger("duplex.server")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
_ANTHROPIC_PREFIX = "/v1/messages"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    served_model_names: tuple[str, ...] = ()  # empty: the model's own name
    max_queued_requests: int = 256
    # Admission by work (frontend.admission): sequences (prompts x n) and prompt tokens held
    # at once, and how many sequences run in the engine at once (the rest wait their turn).
    max_queued_sequences: int = 512
    max_queued_prompt_tokens: int = 4 * 1024 * 1024
    max_running_sequences: int = 64
    max_n: int = 8
    request_timeout_s: float = 600.0  # 0: no deadline
    api_keys: tuple[str, ...] = ()
    metrics_public: bool = False  # True: /metrics open even with api_keys
    client_max_size: int = 16 * 1024 * 1024
    web_dir: Path | None = WEB_DIR
    allowed_origins: tuple[str, ...] = ()  # CORS; "*": any origin
    chat_template: str | None = None  # --chat-template: replaces the model's own template
    # --tool-call-parser (engine/text/tool_formats.py): None detects it from the chat template
    # (deepseek_v3, qwen3_coder) and is hermes otherwise
    tool_call_parser: str | None = None
    # A client's own chat template decides where control tokens go (it can write a fake
    # system turn): a trust decision, so off unless the operator turns it on.
    allow_request_chat_template: bool = False
    # --reasoning-parser (engine/text/reasoning.py): None detects it from the chat template
    # where that is unambiguous; "none" turns it off
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        for name in ("max_queued_sequences", "max_queued_prompt_tokens",
                     "max_running_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.max_n <= 128:
            raise ValueError(f"max_n must be in [1, 128], got {self.max_n}")
        if self.tool_call_parser not in (None, *TOOL_FORMATS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_FORMATS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, "none"):
            check_parser_name(self.reasoning_parser)
        if self.request_timeout_s < 0:
            raise ValueError(f"request_timeout_s must be >= 0, got {self.request_timeout_s}")


class Admission:
    """Owns the count of requests the frontend accepted and has not finished."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self.num_active = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def slot(self):
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise ApiError("unavailable", "the server is shutting down")
        if self.num_active >= self.limit:
            self.metrics.rejected.labels("overloaded").inc()
            raise ApiError("overloaded", f"the server is at its limit of {self.limit} queued "
                           "requests; retry later", code="overloaded")
        self._change(+1)
        try:
            yield
        finally:
            self._change(-1)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the admitted ones; True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def _change(self, step: int) -> None:
        self.num_active += step
        self.metrics.in_flight.set(self.num_active)
        if self.num_active == 0:
            self._idle.set()
        else:
            self._idle.clear()


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
    def encode_reply_start(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def new_detokenizer(self, skip_special_tokens: bool = True): ...


class AppState:
    """What every handler shares. The engine client and recipe are built by `serve`
    (or fakes in tests); everything else is derived from them here."""

    def __init__(self, engine: Engine, recipe: TextRecipe, options: ServerOptions = ServerOptions(),
                 metrics: Metrics | None = None, supervisor=None) -> None:
        self.engine = engine
        self.recipe = recipe
        self.supervisor = supervisor  # frontend.supervisor.Supervisor, None in tests
        if options.tool_call_parser is None:  # the format the served template writes
            options = dataclasses.replace(options, tool_call_parser=detect_tool_format(
                options.chat_template or recipe.template) or "hermes")
        self.options = options
        self.metrics = metrics or Metrics()
        self.work = WorkAdmission(options.max_queued_sequences,
                                  options.max_queued_prompt_tokens,
                                  options.max_running_sequences, self.metrics)
        self.reasoning = reasoning_format(options, recipe)
        self.pipeline = Pipeline(engine, recipe, self.metrics,
                                 request_timeout_s=options.request_timeout_s,
                                 admission=self.work, reasoning=self.reasoning)
        self.admission = Admission(options.max_queued_requests, self.metrics)
        self.keys = ApiKeys(list(options.api_keys), options.metrics_public)
        self.started = int(time.time())
        # big bodies: read in steps, decoded, rendered and tokenized off the loop
        self.cpu = CpuPool(max_body_bytes=options.client_max_size)
        self.max_token_chars = longest_token_chars(recipe)

    # ------------------------------------------------------------ readiness and admission
    @property
    def is_ready(self) -> bool:
        return bool(self.engine.ready) and not self.admission.draining

    def admit(self) -> contextlib.AbstractContextManager:
        """A slot for one request; raises ApiError (overloaded / unavailable) at once."""
        if not self.admission.draining and not self.engine.ready:
            self.metrics.rejected.labels("not_ready").inc()
            raise ApiError("unavailable", "no engine worker is ready; retry shortly")
        return self.admission.slot()

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
        if info is None:
            raise ApiError("unavailable", "no engine worker is ready; retry shortly")
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

    # ------------------------------------------------------------ tokenizing
    def encode_chat(self, chat: Chat, add_generation_prompt: bool = True,
                    template: str | None = None,
                    continue_final_message: bool = False,
                    variables: dict | None = None) -> list[int]:
        """Prompt ids of a normalized chat (built from the request's structs, see
        engine/text/messages.py); the template's refusals become 400s."""
        if not chat.messages:
            raise invalid("messages must not be empty", param="messages")
        if template is not None and not self.options.allow_request_chat_template:
            raise invalid("a per-request chat_template is disabled on this server (the "
                          "operator can allow it with --allow-request-chat-template)",
                          param="chat_template", code="chat_template_disabled")
        self._check_chars(text_chars(chat.messages) + text_chars(chat.tools), "messages")
        template = template if template is not None else self.options.chat_template
        extra = {"variables": variables} if variables else {}  # fakes need not know it
        try:
            if continue_final_message:  # keyword only when used: fakes need not know it
                return self.recipe.encode_chat(chat, template=template,
                                               continue_final_message=True, **extra)
            return self.recipe.encode_chat(chat, add_generation_prompt=add_generation_prompt,
                                           template=template, **extra)
        except (ValueError, TypeError) as e:  # RecipeError is a ValueError
            raise invalid(f"cannot apply the chat template: {e}", param="messages") from None

    def force_tool_call(self, prompt_ids: list[int], tool_names: list[str], name: str | None,
                        template: str | None = None) -> tuple[list[int], str]:
        """(prompt ids that end inside the start of a tool call, that start's text), for
        tool_choice 'required' / 'any' (name None) or a named tool."""
        source = template if template is not None else \
            self.options.chat_template or self.recipe.template
        if not tools_supported(source):
            raise invalid("this model's chat template has no tool calling, so a required or "
                          "named tool_choice cannot be honoured", param="tool_choice")
        forced = forced_call_prefix(tool_names, name)
        return prompt_ids + self.recipe.encode_reply_start(forced), forced

    def encode_prompt(self, text: str) -> list[int]:
        self._check_chars(text_chars(text), "prompt")
        try:
            return self.recipe.encode_prompt(text)
        except (ValueError, TypeError) as e:
            raise invalid(f"cannot tokenize the prompt: {e}", param="prompt") from None

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long for the context in any tokenization."""
        info = self.engine.ready_info
        if info is not None:
            check_prompt_chars(num_chars, info.max_model_len, self.max_token_chars, param)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.recipe.vocab_size
        if any(t >= vocab_size for t in token_ids):
            raise invalid(f"token ids must be below the vocabulary size {vocab_size}",
                          param=param)

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


# ================================================================ the application
def build_app(state: AppState) -> web.Application:
    app = web.Application(client_max_size=state.options.client_max_size,
                          middlewares=[_middleware(state)])
    setup_cors(app, state.options.allowed_origins)
    app.router.add_routes(openai_api.OpenAIApi(state).routes())
    app.router.add_routes(anthropic_api.AnthropicApi(state).routes())
    ws_api = ws.WebSocketApi(state)
    app.router.add_routes(ws_api.routes())
    app.on_shutdown.append(ws_api.close_all)
    app[CPU_POOL] = state.cpu
    app.on_cleanup.append(lambda _app: _close_pool(state.cpu))
    app.router.add_routes(OpsApi(state).routes())
    _add_web_ui(app, state.options.web_dir)
    return app


async def _close_pool(pool: CpuPool) -> None:
    pool.close()


class OpsApi:
    """/health, /v1/status, /metrics, /openapi.json."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/health", self.health), web.get("/v1/status", self.status),
                web.get("/metrics", self.metrics), web.get("/openapi.json", self.openapi)]

    async def health(self, _: web.Request) -> web.Response:
        state = self.state
        num_ready, num_total = state.num_workers()
        body = {"status": state.health_status(), "model": state.model_name,
                "in_flight": state.admission.num_active,
                "workers": {"ready": num_ready, "total": num_total}}
        return json_response(body, status=200 if state.is_ready else 503)

    async def status(self, _: web.Request) -> web.Response:
        return json_response(self.state.status())

    async def metrics(self, _: web.Request) -> web.Response:
        self.state.refresh_metrics()
        return web.Response(body=self.state.metrics.render(self.state.model_name), headers={
            "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def openapi(self, _: web.Request) -> web.Response:
        return json_response(openapi.spec())


def _add_web_ui(app: web.Application, web_dir: Path | None) -> None:
    """/ serves web/index.html; other GETs outside /v1/ serve files under web/, if any."""
    root = web_dir.resolve() if web_dir is not None else None

    async def index(_: web.Request) -> web.StreamResponse:
        if root is not None and (root / "index.html").is_file():
            return web.FileResponse(root / "index.html")
        return json_response({"name": "duplex", "openapi": "/openapi.json",
                              "health": "/health"})

    async def static_file(request: web.Request) -> web.StreamResponse:
        path = (root / request.match_info["path"]).resolve() if root is not None else None
        if path is None or not path.is_relative_to(root) or not path.is_file():
            raise ApiError("not_found", f"no such resource: {request.path}")
        return web.FileResponse(path)

    app.router.add_get("/", index)
    app.router.add_get(r"/{path:(?!v1/).+}", static_file)


def _middleware(state: AppState):
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        request[REQ_ID] = uuid.uuid4().hex[:24]
        REQUEST_ID.set(request[REQ_ID])  # on every log line of this request (engine/logs)
        start = time.perf_counter()
        status = "disconnected"
        try:
            response = await _render_errors(request, handler, state.keys)
            status = str(response.status)
            return response
        finally:
            endpoint = _endpoint(request)
            state.metrics.requests.labels(endpoint, status).inc()
            log.info("http req_id=%s method=%s endpoint=%s status=%s duration_s=%.4f",
                     request[REQ_ID], request.method, endpoint, status,
                     time.perf_counter() - start)
    return middleware


async def _render_errors(request: web.Request, handler, keys: ApiKeys) -> web.StreamResponse:
    try:
        if keys.is_protected(request.path) and not keys.is_allowed(request):
            raise ApiError("authentication", "invalid or missing API key: send it as "
                           "'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key")
        return await handler(request)
    except ApiError as e:
        return render_error(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return render_error(request, ApiError.from_status(e.status, e.text or e.reason))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - a bug must still answer in the API's shape
        log.exception("unhandled error req_id=%s path=%s", request[REQ_ID], request.path)
        return render_error(request, ApiError("internal", "internal server error"))


def render_error(request: web.Request, error: ApiError) -> web.Response:
    if request.path.startswith(_ANTHROPIC_PREFIX):
        return json_response(error.anthropic_body(), error.anthropic_status(), error.headers)
    return json_response(error.openai_body(), error.openai_status(), error.headers)


def _endpoint(request: web.Request) -> str:
    """A bounded label: the route's pattern, never the raw path of an unknown URL."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


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

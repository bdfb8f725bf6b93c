"""The aiohttp application: its options, errors, and the ops endpoints.

`build_app` mounts all five APIs (OpenAI chat and completions, Responses, Anthropic, the
WebSocket) over one `AppState` (frontend/app_state.py, re-exported here), whose intake
(frontend/intake.py) every one of them feeds, with /health, /v1/status, /metrics,
/openapi.json and the web UI. One middleware checks API keys, renders every error in the
calling API's shape, counts requests and logs them. The API modules import nothing from
here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web

from duplex.engine.logs import REQUEST_ID
from duplex.engine.text.reasoning import check_parser_name
from duplex.engine.text.tool_formats import TOOL_FORMATS
from duplex.frontend import anthropic_api, openai_api, openapi, responses_api, ws
from duplex.frontend.app_state import AppState  # serve and the tests import it from here too
from duplex.frontend.auth import ApiKeys
from duplex.frontend.cors import setup_cors
from duplex.frontend.errors import ApiError
from duplex.frontend.offload import CPU_POOL, CpuPool
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


# ================================================================ the application
def build_app(state: AppState) -> web.Application:
    app = web.Application(client_max_size=state.options.client_max_size,
                          middlewares=[_middleware(state)])
    setup_cors(app, state.options.allowed_origins)
    app.router.add_routes(openai_api.OpenAIApi(state).routes())
    app.router.add_routes(responses_api.ResponsesApi(state).routes())
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

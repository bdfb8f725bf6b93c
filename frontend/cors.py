"""CORS for `--allowed-origins`: lets pages served from other origins call the API.

With no origins configured nothing changes (browsers then allow same-origin calls only).
Otherwise a preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin
is answered 204 here, before the API-key check (a preflight never carries the key), and
every response to an allowed origin gets Access-Control-Allow-Origin. The headers are added
in `on_response_prepare`, so streamed (SSE) responses get them too. No cookies are used,
so credentials are never allowed.
"""
from __future__ import annotations

from aiohttp import web

METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED = "Retry-After, Content-Type"
MAX_AGE_S = 600


def setup_cors(app: web.Application, origins: tuple[str, ...]) -> None:
    if not origins:
        return
    allowed = _matcher(origins)

    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        is_preflight = (request.method == "OPTIONS"
                        and "Access-Control-Request-Method" in request.headers)
        if is_preflight and origin and allowed(origin):
            requested = request.headers.get("Access-Control-Request-Headers", "")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": METHODS,
                "Access-Control-Allow-Headers": requested or "authorization, content-type",
                "Access-Control-Max-Age": str(MAX_AGE_S)})
        return await handler(request)

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
            response.headers.add("Vary", "Origin")

    app.middlewares.insert(0, preflight)  # outermost: before the API-key check
    app.on_response_prepare.append(add_headers)


def _matcher(origins: tuple[str, ...]):
    if "*" in origins:
        return lambda origin: True
    exact = frozenset(origins)
    return lambda origin: origin.rstrip("/") in exact

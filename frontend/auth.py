"""API keys: who may call the API, and the tenant salt that keeps their KV caches apart.

With no keys configured the server is open. Otherwise every API path (and /metrics, unless
`--metrics-public`) needs one of the keys, as `Authorization: Bearer <key>` or
`x-api-key: <key>` (the OpenAI and Anthropic SDKs' conventions). A browser WebSocket cannot
set headers, so /v1/ws also takes the key inside its subprotocol list:

    new WebSocket(url, ["duplex.v1", "duplex.key." + base64url(utf8(key))])

The server then selects `duplex.v1` (WS_PROTOCOL). The key never travels in a URL, so it
never lands in a proxy's access log or the browser's history; `?api_key=` is not accepted.
/health, the web UI and /openapi.json stay open.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from aiohttp import web

WS_PROTOCOL = "duplex.v1"
WS_KEY_PREFIX = "duplex.key."
_PROTECTED_PREFIXES = ("/v1/", "/tokenize")


class ApiKeys:
    def __init__(self, keys: list[str] | None, metrics_public: bool = False) -> None:
        self._keys = [k.encode() for k in keys or [] if k]
        self._prefixes = _PROTECTED_PREFIXES if metrics_public else (*_PROTECTED_PREFIXES,
                                                                     "/metrics")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def is_protected(self, path: str) -> bool:
        return self.enabled and path.startswith(self._prefixes)

    def is_allowed(self, request: web.Request) -> bool:
        key = presented_key(request)
        if key is None:
            return False
        # compare against every key, so timing does not tell which one nearly matched
        matches = [hmac.compare_digest(key.encode(), k) for k in self._keys]
        return any(matches)

    def tenant_salt(self, request: web.Request, client_salt: str | None) -> str:
        """Cache salt of a request: its tenant (a hash of its API key, when keys are on)
        plus the client's own `cache_salt`. Two tenants never share KV blocks; a tenant may
        split its cache further with `cache_salt`."""
        key = presented_key(request) if self.enabled else None
        tenant = hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""
        return ":".join(part for part in (tenant, client_salt or "") if part)


def presented_key(request: web.Request) -> str | None:
    """The key a request carries: a header, or (WebSocket handshakes) a subprotocol."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key") or subprotocol_key(request)


def subprotocol_key(request: web.Request) -> str | None:
    """The key in a `duplex.key.<base64url>` entry of Sec-WebSocket-Protocol, if any."""
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    for token in (t.strip() for t in offered.split(",")):
        if token.startswith(WS_KEY_PREFIX):
            return _decode_key(token[len(WS_KEY_PREFIX):])
    return None


def _decode_key(text: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None

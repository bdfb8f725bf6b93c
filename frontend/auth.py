"""API keys: who may call the API, and the tenant salt that keeps their KV caches apart.

With no keys configured the server is open. Otherwise every API path needs one of the
keys, as `Authorization: Bearer <key>` or `x-api-key: <key>` (the OpenAI and Anthropic
SDKs' conventions) or, for browser WebSockets that cannot set headers, `?api_key=<key>`.
/health, the web UI and /openapi.json stay open.
"""
from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

_PROTECTED_PREFIXES = ("/v1/", "/tokenize")


class ApiKeys:
    def __init__(self, keys: list[str] | None) -> None:
        self._keys = [k.encode() for k in keys or [] if k]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def is_protected(self, path: str) -> bool:
        return self.enabled and path.startswith(_PROTECTED_PREFIXES)

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
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key") or request.query.get("api_key")

"""Which retention class (chat / agent) a request's KV blocks get, from what the client sent.

Owns the reading of the `x-duplex-retention` header and the `retention` body field; the
classes and the rule itself live in `kvstore.retention.classify`. An unknown value, or a
header and a body field that disagree, is a 400 in the API's own shape.
"""
from __future__ import annotations

from aiohttp import web

from duplex.frontend.errors import invalid
from duplex.kvstore.retention import CLASSES, classify

HEADER = "x-duplex-retention"


def request_retention(request: web.Request | None, body_value: str | None,
                      has_tools: bool) -> str:
    """Retention class of one request: explicit header or body value, else agent iff tools."""
    header = request.headers.get(HEADER) if request is not None else None
    if header is not None:
        header = header.strip().lower()
        if header not in CLASSES:
            raise invalid(f"header {HEADER} must be one of {list(CLASSES)}, got {header!r}",
                          param=HEADER)
    if header is not None and body_value is not None and header != body_value:
        raise invalid(f"header {HEADER}: {header} contradicts body field retention: "
                      f"{body_value}", param="retention")
    explicit = body_value if body_value is not None else header
    try:
        return classify(explicit, has_tools)
    except ValueError as exc:
        raise invalid(str(exc), param="retention") from exc

"""`duplex serve` flags an operator reaches for, with the vLLM spellings where Duplex has the
same knob: a positional MODEL, --chat-template FILE, --allowed-origins (CORS),
--ssl-certfile/--ssl-keyfile (TLS), --log-format text|json and --metrics-public.

Each helper turns one flag into what the server takes, raising ValueError or OSError with a
message for `duplex serve: ...` (exit code 2) before anything starts.
"""
from __future__ import annotations

import argparse
import copy
import json
import ssl
from pathlib import Path

from duplex.engine.logs import LOG_FORMATS

MAX_TEMPLATE_CHARS = 256_000  # as the recipe's RenderLimits.template_chars


def add_operator_arguments(group) -> None:
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="Jinja chat template to use instead of the model's own (vLLM's "
                            "flag); rendered by the same sandboxed, injection-safe recipe; "
                            "frontend/templates/smollm2_tools.jinja (shipped) adds Hermes-style "
                            "tool calling to SmolLM2")
    group.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                       help="browser origins allowed to call the API from other sites (CORS), "
                            "comma-separated, repeated or a JSON list, e.g. "
                            "https://app.example.com; '*': any (default: none, same-origin only)")
    group.add_argument("--ssl-certfile", default=None, metavar="FILE",
                       help="serve HTTPS / WSS with this PEM certificate (chain)")
    group.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                       help="private key of --ssl-certfile (PEM)")
    group.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                       help="log lines as text or as one JSON object each; both carry the "
                            "request id on every line of a request")
    group.add_argument("--metrics-public", action="store_true",
                       help="serve /metrics without the API key (default: behind --api-key "
                            "when keys are set)")


def take_positional_model(args: argparse.Namespace) -> None:
    """`duplex serve MODEL` is `--model MODEL`; both at once must agree."""
    positional = getattr(args, "model_arg", None)
    if positional is None:
        return
    if args.model is not None and args.model != positional:
        raise ValueError(f"MODEL {positional!r} and --model {args.model!r} disagree; give one")
    from duplex.frontend.cli_config import override
    override(args, "model", positional, "cli", "MODEL")


def parse_origins(values: list[str]) -> tuple[str, ...]:
    """Comma-separated or repeated; a JSON list too (vLLM's `--allowed-origins '["*"]'`)."""
    origins = tuple(o.strip().rstrip("/") for v in values for o in _split(v) if o.strip())
    for origin in origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin "
                             "(scheme://host[:port], or '*')")
    return origins


def _split(value: str) -> list[str]:
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            raise ValueError(f"--allowed-origins: {value!r} is not a JSON list") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"--allowed-origins: {value!r} is not a list of strings")
        return items
    return value.split(",")


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    if len(text) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"--chat-template {path}: over {MAX_TEMPLATE_CHARS} characters")
    return text


def with_chat_template(recipe, template: str | None):
    """The recipe with `template` as its chat template. Recipes are cached per model and
    shared, so this changes a copy, never the cached one."""
    if template is None:
        return recipe
    custom = copy.copy(recipe)
    custom.template = template
    return custom


def tls_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if certfile is None and keyfile is None:
        return None
    if certfile is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load them: {e}") from None
    return context

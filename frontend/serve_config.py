"""The one frozen config of `duplex serve`, validated at construction.

    ServeConfig
      .engine    EngineConfig (engine/config.py): every engine setting, and the served
                 workers' policy in its sections: scheduler.fair_prefill, worker.handoff_lease_s,
                 worker.worker_key (a file path), worker.log_format, worker.switches (the
                 kernels.switches values of this process)
      .layout    WorkerLayout: which worker processes serve and how requests spread over them
      .server    ServerOptions (frontend/server.py): what the HTTP side admits and answers
      host, port, TLS files, shutdown timeout, log level

Each setting lives in one field. `.engine` is what every worker receives, serialized once as
JSON by the supervisor (never pickled, never re-rendered as flags). A combination that cannot
work, or a setting that nothing would read, is refused here with a one-line reason naming
the flags; what only the model or the worker's host can tell (--cuda-graphs with --device
auto, or on a model with sliding-window layers) the worker refuses before it connects
(engine/worker_cli.check_model).
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from duplex.engine import curve
from duplex.engine.args import engine_config_from_args, worker_policy_from_args
from duplex.engine.config import DEFAULT_MODEL_NAME, HANDOFF_LEASE_S, EngineConfig
from duplex.frontend.operator_flags import parse_origins, read_chat_template
from duplex.frontend.router import DEFAULT_BUCKETS, parse_buckets
from duplex.frontend.server import ServerOptions
from duplex.kernels import switches

TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "smollm2_tools.jinja"


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """Which worker processes serve, and how requests are spread over them."""
    num_prefill: int = 0  # 0 and 0: one unified worker
    num_decode: int = 0
    length_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    handoff_failure: str = "recompute"
    worker_bind: str | None = None  # None: a private ipc socket

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("--prefill-workers and --decode-workers must be >= 0")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError("a split needs both --prefill-workers and --decode-workers >= 1")

    @property
    def is_split(self) -> bool:
        return self.num_prefill > 0

    @property
    def roles(self) -> tuple[str, ...]:
        if not self.is_split:
            return ("unified",)
        return ("prefill",) * self.num_prefill + ("decode",) * self.num_decode


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    layout: WorkerLayout = dataclasses.field(default_factory=WorkerLayout)
    server: ServerOptions = dataclasses.field(default_factory=ServerOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        engine, layout = self.engine, self.layout
        if engine.ep.is_on and layout.is_split:
            raise ValueError("--expert-parallel runs with one unified worker; it cannot be "
                             "combined with --prefill-workers / --decode-workers yet")
        if not layout.is_split and engine.worker.handoff_lease_s != HANDOFF_LEASE_S:
            raise ValueError("--handoff-lease-s is read by prefill workers only: it needs "
                             "--prefill-workers N --decode-workers M (this layout is one "
                             "unified worker)")
        if engine.worker.role != "unified":
            raise ValueError("a served config's role stays unified: each worker's role is "
                             "its slot's (--prefill-workers / --decode-workers)")

    @property
    def log_format(self) -> str:
        return self.engine.worker.log_format


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of a `duplex serve` command line (after `normalize_args`); a refused
    setting raises ValueError, an unreadable file OSError."""
    engine = engine_config_from_args(args)
    engine = engine.replace(**worker_policy_from_args(args, engine), log_format=args.log_format,
                            switches=switches.current())
    layout = layout_from_args(args)
    curve.load_keys(engine.worker.worker_key, layout.worker_bind)  # a bad key fails here
    return ServeConfig(engine, layout, server_options_from_args(args, engine), args.host,
                       args.port, args.ssl_certfile, args.ssl_keyfile, args.shutdown_timeout,
                       args.log_level)


def layout_from_args(args: argparse.Namespace) -> WorkerLayout:
    return WorkerLayout(args.prefill_workers, args.decode_workers,
                        parse_buckets(args.length_buckets), args.handoff_failure,
                        args.worker_bind)


def server_options_from_args(args: argparse.Namespace, engine: EngineConfig) -> ServerOptions:
    return ServerOptions(
        served_model_names=tuple(args.served_model_name) or (model_name(engine.model),),
        max_queued_requests=args.max_queued_requests, max_n=args.max_n,
        request_timeout_s=args.request_timeout, api_keys=tuple(args.api_key),
        client_max_size=args.max_body_bytes, metrics_public=args.metrics_public,
        allowed_origins=parse_origins(args.allowed_origins),
        chat_template=read_chat_template(args.chat_template)
        or default_chat_template(engine.model),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allow_request_chat_template=args.allow_request_chat_template,
        max_queued_sequences=args.max_queued_sequences,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        max_running_sequences=args.max_running_sequences
        or engine.scheduler.max_num_seqs * max(1, args.decode_workers))


def default_chat_template(model: str | None) -> str | None:
    """The template served when no --chat-template is given: for the default model, its own
    ChatML with Hermes-style tool calling (frontend/templates/smollm2_tools.jinja), so the
    README's tool examples work on `make serve`; for any other model, its own (None)."""
    return TOOLS_TEMPLATE.read_text(encoding="utf-8") if model is None else None


def model_name(model: str | None) -> str:
    """The name clients use by default: the default model's, or the file / directory name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name

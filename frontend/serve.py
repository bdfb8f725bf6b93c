"""`duplex serve`: the API server process (aiohttp on uvloop) and its engine workers.

    1 parse flags -> EngineConfig + ServerOptions + WorkerLayout
    2 load the recipe (tokenizer, chat template) of the model
    3 start the supervisor (one unified worker process, or --prefill-workers N and
      --decode-workers M) and the EngineClient (with its router) talking to them; with
      --expert-parallel N the unified worker starts N-1 more ranks of its own (engine/ep_group)
    4 serve HTTP at once (/health says 503 until the worker is ready); print the URL when ready
    5 on SIGTERM / SIGINT: refuse new requests (503), let in-flight ones finish for up to
      --shutdown-timeout, end the rest with one terminal error each, stop the worker, exit 0
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from duplex.engine.args import add_engine_arguments, engine_config_from_args
from duplex.engine import curve
from duplex.engine.config import (DEFAULT_MODEL_NAME, HANDOFF_LEASE_S, EngineConfig,
                           resolve_model_path)
from duplex.engine.logs import LOG_FORMAT_ENV, setup_logging
from duplex.engine.text.reasoning import REASONING_PARSERS
from duplex.frontend.offload import SWITCH_INTERVAL_S
from duplex.frontend.operator_flags import (add_operator_arguments, parse_origins, read_chat_template,
                                     take_positional_model, tls_context, with_chat_template)
from duplex.frontend.router import DEFAULT_BUCKETS, parse_buckets
from duplex.frontend.generation import reasoning_format
from duplex.frontend.server import AppState, ServerOptions, build_app

log = logging.getLogger("duplex.serve")

# After the drain timeout, streams still open get their terminal error; this long to send it.
FINAL_FLUSH_S = 2.0
TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "smollm2_tools.jinja"


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """Which worker processes serve, and how requests are spread over them."""
    num_prefill: int = 0  # 0 and 0: one unified worker
    num_decode: int = 0
    length_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    handoff_failure: str = "recompute"
    handoff_lease_s: float = HANDOFF_LEASE_S
    fair_prefill: bool = True
    worker_bind: str | None = None  # None: a private ipc socket
    worker_key: str | None = None  # CURVE key file (engine.curve); needed off this host

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("--prefill-workers and --decode-workers must be >= 0")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError("a split needs both --prefill-workers and --decode-workers >= 1")

    @property
    def roles(self) -> tuple[str, ...]:
        if not self.num_prefill:
            return ("unified",)
        return ("prefill",) * self.num_prefill + ("decode",) * self.num_decode

    def worker_args(self) -> list[str]:
        key = ["--worker-key", self.worker_key] if self.worker_key else []
        return ["--handoff-lease-s", str(self.handoff_lease_s),
                "--fair-prefill" if self.fair_prefill else "--no-fair-prefill", *key]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model takes it (vLLM's `serve MODEL`)")
    add_engine_arguments(parser)
    _add_server_arguments(parser.add_argument_group("server"))
    _add_worker_arguments(parser.add_argument_group("workers"))


def _add_server_arguments(group) -> None:
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    group.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="accept this API key (Bearer or x-api-key); repeatable; none: open")
    group.add_argument("--max-queued-requests", type=int, default=256, metavar="N",
                       help="requests in flight (running + waiting) before answering 429/529")
    group.add_argument("--max-queued-sequences", type=int, default=512, metavar="N",
                       help="sequences (prompts x n) held at once, running or waiting; past it "
                            "429/529, and one request asking for more is a 400")
    group.add_argument("--max-queued-prompt-tokens", type=int, default=4 * 1024 * 1024,
                       metavar="N", help="prompt tokens held at once (same rules)")
    group.add_argument("--max-running-sequences", type=int, default=None, metavar="N",
                       help="sequences sent to the workers at once; the rest wait for a turn, "
                            "round-robin by tenant then request (default: --max-num-seqs x "
                            "decoding workers)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                       help="on SIGTERM, seconds to let in-flight requests finish")
    group.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                       help="deadline of one request in seconds (0: none)")
    group.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                       help="model name(s) clients use; the first is reported (default: the "
                            "model's name)")
    group.add_argument("--max-n", type=int, default=8, metavar="N",
                       help="largest n (choices per request)")
    group.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, metavar="B",
                       help="largest request body accepted")
    group.add_argument("--tool-call-parser", default=None,
                       choices=["hermes", "llama3_json", "mistral", "pythonic", "deepseek_v3",
                                "qwen3_coder"],
                       help="how the model writes tool calls: parsed from its output and, "
                            "except pythonic, constrained for tool_choice (default: detected "
                            "from the chat template: deepseek_v3 for DeepSeek's tool-call "
                            "tokens, qwen3_coder for Qwen3-Coder's <function=...> calls, "
                            "else hermes)")
    group.add_argument("--reasoning-parser", default=None,
                       choices=[*REASONING_PARSERS, "none"],
                       help="split the model's thinking block from its answer (reasoning in "
                            "every API); default: detected from the chat template where that "
                            "is unambiguous (Qwen3, DeepSeek-R1), else none")
    group.add_argument("--allow-request-chat-template", action="store_true",
                       help="accept a chat_template in request bodies (a trust decision: the "
                            "caller then places control tokens, e.g. a fake system turn)")
    group.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"], help="log level")
    add_operator_arguments(group)


def _add_worker_arguments(workers) -> None:
    workers.add_argument("--prefill-workers", type=int, default=0, metavar="N",
                         help="prefill worker processes (with --decode-workers; default: one "
                              "unified worker)")
    workers.add_argument("--decode-workers", type=int, default=0, metavar="M",
                         help="decode worker processes (with --prefill-workers)")
    workers.add_argument("--worker-bind", default=None, metavar="ADDRESS",
                         help="bind the worker channel here (tcp://HOST:PORT), so that more "
                              "workers can join with `duplex worker --connect` (default: a "
                              "private ipc socket)")
    workers.add_argument("--worker-key", default=None, metavar="FILE",
                         help="CURVE key (`duplex keys FILE`, or a shared-secret file) that "
                              "authenticates and encrypts the worker channel and KV doors; "
                              "required when --worker-bind is reachable from other hosts")
    workers.add_argument("--length-buckets", default=",".join(map(str, DEFAULT_BUCKETS)),
                         metavar="B1,B2", help="prefill queues by prompt tokens after cache "
                         "hits: <=B1, <=B2, >B2 ('none': one FIFO)")
    workers.add_argument("--handoff-failure", choices=["recompute", "fail"],
                         default="recompute", help="when a KV hand-off or a worker fails: "
                         "recompute the stream on a live worker, or fail it")
    workers.add_argument("--handoff-lease-s", type=float, default=HANDOFF_LEASE_S,
                         metavar="S",
                         help="longest a prefill worker holds blocks for a decode worker")
    workers.add_argument("--fair-prefill", action=argparse.BooleanOptionalAction,
                         default=True, help="long prompts leave part of each step to short "
                         "ones and to running streams")


def normalize_args(args: argparse.Namespace) -> None:
    """What --print-config and `run` see alike: `serve MODEL` is `--model MODEL`."""
    take_positional_model(args)


def run(args: argparse.Namespace) -> int:
    try:
        normalize_args(args)
        config = engine_config_from_args(args)
        options = ServerOptions(
            served_model_names=tuple(args.served_model_name) or (model_name(config.model),),
            max_queued_requests=args.max_queued_requests, max_n=args.max_n,
            request_timeout_s=args.request_timeout, api_keys=tuple(args.api_key),
            client_max_size=args.max_body_bytes, metrics_public=args.metrics_public,
            allowed_origins=parse_origins(args.allowed_origins),
            chat_template=read_chat_template(args.chat_template)
            or default_chat_template(config.model),
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            allow_request_chat_template=args.allow_request_chat_template,
            max_queued_sequences=args.max_queued_sequences,
            max_queued_prompt_tokens=args.max_queued_prompt_tokens,
            max_running_sequences=args.max_running_sequences
            or config.scheduler.max_num_seqs * max(1, args.decode_workers))
        model_path = resolve_model_path(config.model)
        chat_template = options.chat_template
        ssl_context = tls_context(args.ssl_certfile, args.ssl_keyfile)
        layout = layout_from_args(args)
        curve.load_keys(layout.worker_key, layout.worker_bind)  # a bad key fails here
        if config.ep.expert_parallel > 1 and layout.num_prefill:
            raise ValueError("--expert-parallel runs with one unified worker; it cannot be "
                             "combined with --prefill-workers / --decode-workers yet")
    except (ValueError, OSError) as e:
        print(f"duplex serve: {e}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, args.log_format)
    os.environ[LOG_FORMAT_ENV] = args.log_format  # the workers it starts log the same way
    import uvloop
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the loop gets the GIL back from pool threads
    return uvloop.run(serve(config, options, model_path, args.host, args.port,
                            args.shutdown_timeout, layout, ssl_context=ssl_context,
                            chat_template=chat_template))


def layout_from_args(args: argparse.Namespace) -> WorkerLayout:
    return WorkerLayout(args.prefill_workers, args.decode_workers,
                        parse_buckets(args.length_buckets), args.handoff_failure,
                        args.handoff_lease_s, args.fair_prefill, args.worker_bind,
                        args.worker_key)


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


async def serve(config: EngineConfig, options: ServerOptions, model_path: str, host: str,
                port: int, shutdown_timeout_s: float,
                layout: WorkerLayout = WorkerLayout(), ssl_context=None,
                chat_template: str | None = None) -> int:
    from duplex.frontend.engine_client import EngineClient
    from duplex.engine.text.recipe import Recipe
    from duplex.frontend.router import DEFAULT_BUCKET_LIMITS, Router
    from duplex.frontend.supervisor import Supervisor

    if not _is_readable(model_path):  # not a GGUF at all: one line, before any worker
        return 2
    recipe = with_chat_template(Recipe.from_model(model_path), chat_template)
    try:
        reasoning_format(options, recipe)  # a parser that does not fit: refused here
    except ValueError as e:
        print(f"duplex serve: {e}", file=sys.stderr)
        return 2
    supervisor = Supervisor(config, roles=layout.roles, worker_args=layout.worker_args(),
                            address=layout.worker_bind)
    limits = DEFAULT_BUCKET_LIMITS if layout.length_buckets else (options.max_queued_requests,)
    engine = EngineClient(supervisor.address, handoff_failure=layout.handoff_failure,
                          router=Router(layout.length_buckets, limits),
                          keys=curve.load_keys(layout.worker_key, layout.worker_bind))
    supervisor.attach(engine)
    state = AppState(engine, recipe, options, supervisor=supervisor)
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    stop, force = _signal_events()
    supervisor.on_startup_failure(lambda reason: stop.set())
    try:
        await engine.start()
        await supervisor.start()
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        log.info("listening host=%s port=%d tls=%s (waiting for the engine worker)", host, port,
                 ssl_context is not None)
        scheme = "https" if ssl_context is not None else "http"
        await _announce_when_ready(engine, stop, f"{scheme}://{host}:{port}", options, layout,
                                   config.ep.expert_parallel)
        await stop.wait()
        if supervisor.startup_failure:  # a worker that can never start: no server to run
            return _startup_failed(supervisor.startup_failure)
        log.info("shutting down: draining in-flight=%d timeout_s=%.1f",
                 state.admission.num_active, shutdown_timeout_s)
        drained = await _drain(state, shutdown_timeout_s, force)
        ending = drain_outcome(drained, force.is_set(), state.admission.num_active,
                               shutdown_timeout_s)
        if ending:
            log.warning(ending)
    except OSError as e:
        print(f"duplex serve: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    finally:
        await engine.close()  # every open stream gets its one terminal error event
        await state.admission.drain(FINAL_FLUSH_S)
        await runner.cleanup()
        await supervisor.close()
    log.info("stopped")
    return 0


def _is_readable(model_path: str) -> bool:
    """False (after saying why in one line) for a .gguf path that is no complete GGUF file."""
    from duplex.engine.models.gguf_file import open_reader

    try:
        if model_path.endswith(".gguf"):
            open_reader(model_path)
        return True
    except ValueError as e:  # ModelLoadError
        print(f"duplex serve: {e}", file=sys.stderr)
        return False


def _startup_failed(reason: str) -> int:
    print(f"duplex serve: {reason}", file=sys.stderr)
    return 1


def drain_outcome(drained: bool, forced: bool, num_active: int, timeout_s: float) -> str | None:
    """The line to log when a drain did not let every request finish (None when it did, or
    when nothing was left running by the time a second signal came)."""
    if drained or not num_active:
        return None
    why = ("a second signal cut the drain short" if forced
           else f"the drain timeout of {timeout_s:.1f} s passed")
    return f"{why}; ending in-flight={num_active} with an error"


def _signal_events() -> tuple[asyncio.Event, asyncio.Event]:
    """(stop, force): the first SIGTERM / SIGINT asks for a drain, a second one cuts it short."""
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    return stop, force


async def _drain(state: AppState, timeout_s: float, force: asyncio.Event) -> bool:
    """True when every admitted request finished within the timeout (and no second signal)."""
    drained = asyncio.ensure_future(state.admission.drain(timeout_s))
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait([drained, forced], return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if not drained.done():
        drained.cancel()
        return False
    return drained.result()


async def _announce_when_ready(engine, stop: asyncio.Event, url: str, options: ServerOptions,
                               layout: WorkerLayout = WorkerLayout(),
                               expert_parallel: int = 1) -> None:
    """Print the URL once the worker is ready (or give up waiting when asked to stop)."""
    ready = asyncio.ensure_future(engine.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not ready.done():
        ready.cancel()
        return
    info = ready.result()
    print(f"Duplex is serving {options.served_model_names[0]} at {url} "
          f"(max_model_len={info.max_model_len}, worker={_describe(layout, expert_parallel)})",
          flush=True)


def _describe(layout: WorkerLayout, expert_parallel: int = 1) -> str:
    if expert_parallel > 1:
        return f"unified over {expert_parallel} expert-parallel ranks"
    if not layout.num_prefill:
        return "unified"
    return f"{layout.num_prefill} prefill + {layout.num_decode} decode"

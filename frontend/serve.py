"""`duplex serve`: the API server process (aiohttp on uvloop) and its engine workers.

    1 parse flags -> one frozen ServeConfig (frontend/serve_config.py): EngineConfig +
      WorkerLayout + ServerOptions, refused with its reason when a combination cannot work
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
import logging
import signal
import sys

from aiohttp import web

from duplex.engine import curve
from duplex.engine.args import add_engine_arguments, add_worker_policy_arguments
from duplex.engine.config import resolve_model_path
from duplex.engine.logs import JsonFormatter, setup_logging
from duplex.engine.text.reasoning import REASONING_PARSERS
from duplex.frontend.offload import SWITCH_INTERVAL_S
from duplex.frontend.operator_flags import (add_operator_arguments, take_positional_model,
                                            tls_context, with_chat_template)
from duplex.frontend.router import DEFAULT_BUCKETS
from duplex.frontend.cli_config import override
from duplex.frontend.generation import reasoning_format
from duplex.frontend.serve_config import (TOOLS_TEMPLATE, ServeConfig, WorkerLayout,  # noqa: F401
                                          default_chat_template, layout_from_args, model_name,
                                          serve_config_from_args)
from duplex.frontend.server import AppState, build_app

log = logging.getLogger("duplex.serve")

# After the drain timeout, streams still open get their terminal error; this long to send it.
FINAL_FLUSH_S = 2.0


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
    workers.add_argument("--length-buckets", default=",".join(map(str, DEFAULT_BUCKETS)),
                         metavar="B1,B2", help="prefill queues by prompt tokens after cache "
                         "hits: <=B1, <=B2, >B2 ('none': one FIFO)")
    workers.add_argument("--handoff-failure", choices=["recompute", "fail"],
                         default="recompute", help="when a KV hand-off or a worker fails: "
                         "recompute the stream on a live worker, or fail it")
    add_worker_policy_arguments(workers)


def normalize_args(args: argparse.Namespace) -> None:
    """What --print-config and `run` see alike: `serve MODEL` is `--model MODEL`, and
    --fair-prefill left out is on, except in an expert-parallel group."""
    take_positional_model(args)
    if args.fair_prefill is None:
        override(args, "fair_prefill", args.expert_parallel <= 1, "default", "--fair-prefill")


def run(args: argparse.Namespace) -> int:
    try:
        normalize_args(args)
        config = serve_config_from_args(args)
        model_path = resolve_model_path(config.engine.model)
        ssl_context = tls_context(config.ssl_certfile, config.ssl_keyfile)
    except (ValueError, OSError) as e:
        print(f"duplex serve: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    import uvloop
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the loop gets the GIL back from pool threads
    return uvloop.run(serve(config, model_path, ssl_context=ssl_context))


async def serve(serve_config: ServeConfig, model_path: str, ssl_context=None) -> int:
    from duplex.frontend.dispatcher import Dispatcher
    from duplex.frontend.engine_client import EngineClient
    from duplex.engine.text.recipe import Recipe
    from duplex.frontend.router import DEFAULT_BUCKET_LIMITS, Router
    from duplex.frontend.supervisor import Supervisor

    config, layout, options = serve_config.engine, serve_config.layout, serve_config.server
    host, port = serve_config.host, serve_config.port
    if not _is_readable(model_path):  # not a GGUF at all: one line, before any worker
        return 2
    recipe = with_chat_template(Recipe.from_model(model_path), options.chat_template)
    try:
        reasoning_format(options, recipe)  # a parser that does not fit: refused here
    except ValueError as e:
        print(f"duplex serve: {e}", file=sys.stderr)
        return 2
    supervisor = Supervisor(config, roles=layout.roles, address=layout.worker_bind)
    limits = DEFAULT_BUCKET_LIMITS if layout.length_buckets else (options.max_queued_requests,)
    dispatcher = Dispatcher(Router(layout.length_buckets, limits), layout.handoff_failure)
    engine = EngineClient(supervisor.address, dispatcher=dispatcher,
                          keys=curve.load_keys(config.worker.worker_key, layout.worker_bind))
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
        await _announce_when_ready(engine, stop, f"{scheme}://{host}:{port}", serve_config)
        await stop.wait()
        if supervisor.startup_failure:  # a worker that can never start: no server to run
            return _startup_failed(supervisor.startup_failure)
        shutdown_timeout_s = serve_config.shutdown_timeout_s
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


async def _announce_when_ready(engine, stop: asyncio.Event, url: str,
                               config: ServeConfig) -> None:
    """Print the URL once the worker is ready (or give up waiting when asked to stop)."""
    ready = asyncio.ensure_future(engine.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not ready.done():
        ready.cancel()
        return
    info = ready.result()
    print(banner(f"Duplex is serving {config.server.served_model_names[0]} at {url} "
                 f"(max_model_len={info.max_model_len}, worker={_describe(config)})",
                 config.log_format), flush=True)


def banner(line: str, log_format: str) -> str:
    """The start-up line on stdout, in the configured log format (a JSON log line under
    --log-format json, so every line a server writes parses the same way)."""
    if log_format != "json":
        return line
    record = logging.LogRecord(log.name, logging.INFO, __file__, 0, line, None, None)
    return JsonFormatter().format(record)


def _describe(config: ServeConfig) -> str:
    layout = config.layout
    if config.engine.ep.is_on:
        return f"unified over {config.engine.ep.expert_parallel} expert-parallel ranks"
    if not layout.is_split:
        return "unified"
    return f"{layout.num_prefill} prefill + {layout.num_decode} decode"

"""`duplex worker`: run one engine worker process that connects to a frontend.

    duplex worker --role unified --connect ipc:///tmp/duplex/worker-0.ipc [engine flags]
    duplex worker --role decode --connect tcp://10.0.0.5:5555 --kv-bind tcp://10.0.0.6:5600
    duplex worker --ep-rank 2 --expert-parallel 4 --ep-master 10.0.0.5:29500 [engine flags]

A decode worker binds a KV door (--kv-bind, default a free port on 127.0.0.1) and announces
it to the frontend; prefill workers connect to it to hand over KV blocks. With
--expert-parallel N the worker is rank 0 of an expert-parallel group (engine/ep_group.py);
`--ep-rank R` runs one of the other ranks, which talks only to the group.

The supervisor starts it as `python -m duplex.engine.worker_cli --role R --connect A --worker-id I
--config-json '{...}'`: the one EngineConfig of its server (frontend/serve_config.py), the same
JSON for every worker, carries every setting, the served-worker policy (fair prefill, hand-off
lease, CURVE key file, log format) and the server's kernels.switches included; the flags say
only which process this is. An engine flag beside --config-json is refused; a worker flag
given by hand (--heartbeat-s, --kv-bind, --handoff-lease-s, --fair-prefill, --worker-key,
--log-format) changes that field of the JSON. A flag the role never reads (--handoff-lease-s
without --role prefill, --kv-bind without --role decode) is refused.
Hidden flags: `--core module:attr` picks another core factory (tests use a fake),
`--parent-pid` makes the worker die with that parent, `--startup-error-file PATH` is where the
supervisor reads why a worker never came up.

Exit codes: 0 after Shutdown; 1 when a serving worker fails (the supervisor restarts it);
EXIT_USAGE (bad flags or config) and EXIT_STARTUP_FAILED (the model cannot be loaded, or
the core failed before serving) are start-up failures, never restarted: the worker checks
the model file before it connects, and its reason is one line on stderr, or in the
--startup-error-file when the supervisor gives one.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import logging
import os
import signal
import sys

import msgspec

from duplex.engine.args import (add_engine_arguments, add_worker_policy_arguments,
                                engine_config_from_args, engine_flags_given,
                                worker_policy_from_args)
from duplex.engine.config import LOG_FORMATS, ROLES, EngineConfig, WorkerConfig
from duplex.engine.kv_tiers import private_kv_dir
from duplex.engine.curve import load_keys
from duplex.engine.logs import setup_logging
from duplex.kernels import switches
from duplex.engine.worker import CoreFactory, Worker, role_config

DEFAULT_CORE = "duplex.engine.core:EngineCore"
EXIT_USAGE, EXIT_STARTUP_FAILED = 2, 3
STARTUP_EXIT_CODES = (EXIT_USAGE, EXIT_STARTUP_FAILED)  # the supervisor does not restart these
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("duplex.engine.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=ROLES, default="unified",
                        help="unified (prefill and decode in one scheduler), prefill or decode")
    parser.add_argument("--connect", default=None, metavar="ADDRESS",
                        help="frontend address, tcp://HOST:PORT or ipc://PATH (required, "
                             "except for --ep-rank > 0)")
    parser.add_argument("--ep-rank", type=int, default=0, metavar="R",
                        help="join an expert-parallel group as rank R (1..N-1) of "
                             "--expert-parallel N at --ep-master; rank 0 is the worker that "
                             "`duplex serve` starts")
    parser.add_argument("--worker-id", default=None,
                        help="routing id of this worker (default: ROLE-PID)")
    parser.add_argument("--config-json", default=None, metavar="JSON",
                        help="an EngineConfig as JSON; replaces the engine flags")
    parser.add_argument("--heartbeat-s", type=float, default=None,
                        help=f"seconds between heartbeats (default: {WorkerConfig.heartbeat_s:g})")
    parser.add_argument("--kv-bind", default=None, metavar="ADDRESS",
                        help="decode role: address of the KV door prefill workers connect to "
                             "(tcp://HOST:PORT, port * = any free one; default: "
                             f"{WorkerConfig.kv_bind})")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help="log lines as text or JSON (default: text)")
    parser.add_argument("--cost-model-out", default=None, metavar="JSON",
                        help="on exit, save the step-time cost model here (for `duplex plan`)")
    add_worker_policy_arguments(parser, unset=True)
    parser.add_argument("--core", default=DEFAULT_CORE, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--startup-error-file", default=None, help=argparse.SUPPRESS)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    try:
        config = _config_from(args)
        switches.apply(config.worker.switches)  # before the core loads the kernels
    except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as e:  # its one-line reason
        return _fail_start(args, EXIT_USAGE, str(e))
    setup_logging("info", config.worker.log_format)  # as its server logs
    if args.core == DEFAULT_CORE:
        try:
            check_model(config)
        except (ValueError, FileNotFoundError) as e:  # ModelLoadError is a ValueError
            return _fail_start(args, EXIT_STARTUP_FAILED, str(e))
    if args.ep_rank:
        from duplex.engine.ep_group import follow

        return follow(config, args.ep_rank, started_by_leader=args.parent_pid is not None)
    if args.connect is None:
        return _fail_start(args, EXIT_USAGE, "--connect is required")
    options = config.worker
    try:
        keys = load_keys(options.worker_key, args.connect,
                         options.kv_bind if options.role == "decode" else None)
    except (OSError, ValueError) as e:
        return _fail_start(args, EXIT_USAGE, str(e))
    factory = resolve_core_factory(args.core)
    if config.ep.is_on and args.core == DEFAULT_CORE:
        from duplex.engine.ep_group import leader_core as factory
    worker_id = args.worker_id or f"{options.role}-{os.getpid()}"
    worker = Worker(private_kv_dir(role_config(config), worker_id), factory,
                    address=args.connect, worker_id=worker_id, keys=keys)
    code = _run_on_uvloop(worker)
    if code and worker.core is None:  # failed before its core was built: never served
        return _fail_start(args, EXIT_STARTUP_FAILED, "the engine core failed to start "
                           "(its traceback is in the worker's log above)")
    if args.cost_model_out:
        _save_cost_model(worker, args.cost_model_out)
    return code


def check_model(config: EngineConfig) -> None:
    """Fail now, before connecting, on a model this worker could never load, or a setting
    that it would not use here."""
    from duplex.engine.config import resolve_model_path
    from duplex.engine.models.loader import check

    model_args = check(resolve_model_path(config.model))
    if config.cuda_graphs:
        check_cuda_graphs(config, model_args.layer_windows)


def check_cuda_graphs(config: EngineConfig, layer_windows) -> None:
    """--cuda-graphs where only this host and the model say whether it would run (the config
    already refuses it with --device cpu and with expert parallelism)."""
    import torch

    if config.device == "auto" and not torch.cuda.is_available():
        raise ValueError("--cuda-graphs needs a CUDA device and torch sees none here (--device "
                         "auto is the CPU): drop --cuda-graphs")
    if config.cache.hybrid_kv and any(w is not None for w in layer_windows):
        raise ValueError("--cuda-graphs cannot run with hybrid KV (the model has sliding-window "
                         "layers, whose steps carry a second block table): add --no-hybrid-kv "
                         "or drop --cuda-graphs")


def _fail_start(args: argparse.Namespace, code: int, reason: str) -> int:
    """Report a start-up failure in one line (to the supervisor's file, or stderr)."""
    if args.startup_error_file:
        try:
            with open(args.startup_error_file, "w") as f:
                f.write(reason)
            return code
        except OSError:
            pass
    print(f"duplex worker: {reason}", file=sys.stderr)
    return code


def _save_cost_model(worker: Worker, path: str) -> None:
    model = worker.core.cost_model if worker.core is not None else None
    if model is not None:
        with open(path, "w") as f:
            json.dump({"worker_id": worker.worker_id, "role": worker.role,
                       "cost_model": model.to_dict()}, f, indent=1)


def resolve_core_factory(spec: str) -> CoreFactory:
    """`module:attr` -> the callable that builds a core from an EngineConfig."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--core must look like module:attr, got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


def _config_from(args: argparse.Namespace) -> EngineConfig:
    """The --config-json (or, without one, the engine flags), its worker section changed by
    the worker flags given; a flag that would be dropped or never read is refused."""
    if args.config_json is None:
        config = engine_config_from_args(args)
        config = config.replace(**worker_policy_from_args(args, config),
                                **worker_fields_from_args(args))
    else:
        given = engine_flags_given(args)
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with --config-json, "
                             "which carries the whole engine config")
        config = msgspec.json.decode(args.config_json, type=EngineConfig)
        policy = {name: value for name, value in worker_policy_from_args(args, config).items()
                  if getattr(args, name) is not None}
        config = config.replace(**policy, **worker_fields_from_args(args))
    _refuse_unread_flags(args)
    return config


def worker_fields_from_args(args: argparse.Namespace) -> dict:
    """The worker section's fields by flat name that this process's flags set: its role, and
    each per-process flag given."""
    given = {name: getattr(args, name) for name in ("heartbeat_s", "kv_bind", "log_format")
             if getattr(args, name) is not None}
    return {"role": args.role, **given}


def _refuse_unread_flags(args: argparse.Namespace) -> None:
    if args.handoff_lease_s is not None and args.role != "prefill":
        raise ValueError(f"--handoff-lease-s is read by a prefill worker only, not by --role "
                         f"{args.role}: drop it or use --role prefill")
    if args.kv_bind is not None and args.role != "decode":
        raise ValueError(f"--kv-bind is read by a decode worker only, not by --role {args.role}: "
                         "drop it or use --role decode")


def _run_on_uvloop(worker: Worker) -> int:
    import asyncio

    import uvloop

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, worker.request_shutdown)
        return await worker.run()

    return uvloop.run(main())


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the parent exits, however it exits (no orphans)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the supervisor")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duplex worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""The `duplex` command: one dispatcher, each subcommand defined next to the code it drives.

Each entry names a module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so `duplex chat` never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("frontend.serve", "start the API server and its engine workers"),
    "worker": ("engine.worker_cli", "run one engine worker (unified, prefill or decode)"),
    "generate": ("engine.generate_cli", "generate offline, without a server"),
    "chat": ("frontend.chat", "interactive terminal chat over the WebSocket API"),
    "bench": ("bench.cli", "benchmarks: serve, offline, compare, baseline-server, eplb"),
    "plan": ("engine.plan_cli", "recommend a prefill:decode worker ratio for a workload"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex", description="Duplex LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            try:
                importlib.import_module(module).add_arguments(p)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
                p.set_defaults(_missing=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only=command if command in SUBCOMMANDS else None).parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"duplex {args.command}: not available in this build ({args._missing})",
              file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The `duplex` command: one dispatcher, each subcommand defined next to the code it drives.

Each entry names a module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so `duplex chat` never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("duplex.frontend.serve", "start the API server and its engine workers"),
    "worker": ("duplex.engine.worker_cli", "run one engine worker (unified, prefill or decode)"),
    "generate": ("duplex.engine.generate_cli", "generate offline, without a server"),
    "chat": ("duplex.frontend.chat", "interactive terminal chat over the WebSocket API"),
    "bench": ("duplex.bench.cli", "benchmarks of serving, the engine and its parts (`duplex bench "
              "--help` lists them)"),
    "plan": ("duplex.engine.plan_cli", "recommend a prefill:decode worker ratio for a workload"),
    "keys": ("duplex.engine.keys_cli", "write a CURVE key that authenticates workers across hosts"),
}
# Subcommands whose flags may also come from DUPLEX_* variables and --config (cli_config).
SOURCED = ("serve", "worker")


def version() -> str:
    try:
        return importlib.metadata.version("duplex")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplex", description="Duplex LLM serving engine")
    parser.add_argument("--version", action="version", version=f"duplex {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.subcommands = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = parser.subcommands[name] = sub.add_parser(name, help=help_text,
                                                      description=help_text)
        if only is None or only == name:
            try:
                importlib.import_module(module).add_arguments(p)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
                p.set_defaults(_missing=module)
                continue
            if name in SOURCED:
                from duplex.frontend.cli_config import add_config_arguments
                add_config_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command if command in SUBCOMMANDS else None)
    args = _parse(parser, argv, command)
    if getattr(args, "_missing", None):
        print(f"duplex {args.command}: not available in this build ({args._missing})",
              file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    if getattr(args, "print_config", False):
        from duplex.frontend.cli_config import print_config
        try:
            getattr(module, "normalize_args", lambda _: None)(args)
        except ValueError as e:
            print(f"duplex {args.command}: {e}", file=sys.stderr)
            return 2
        print_config(args)
        return 0
    return int(module.run(args) or 0)


def _parse(parser: argparse.ArgumentParser, argv: list[str],
           command: str | None) -> argparse.Namespace:
    """Plain argparse, except that a SOURCED subcommand also reads env and --config."""
    sub = parser.subcommands.get(command)
    if command not in SOURCED or sub is None or sub.get_default("_missing"):
        return parser.parse_args(argv)
    at = argv.index(command)
    if at:  # options before the command are duplex's own (--help, --version): they exit
        return parser.parse_args(argv)
    from duplex.frontend.cli_config import parse
    args = parse(sub, argv[at + 1:])
    args.command = command
    return args


if __name__ == "__main__":
    sys.exit(main())

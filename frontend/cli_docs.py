"""docs/cli-reference.md, generated from the `duplex` argument parser so that it cannot drift.

    python -m duplex.frontend.cli_docs > docs/cli-reference.md    regenerate it
    python -m duplex.frontend.cli_docs --check                     exit 1 when the file is stale

Walks `frontend.cli.build_parser()` depth first: one section per subcommand (nested ones,
like `duplex bench serve`, included) with its usage and a table per argument group. Usage
lines are wrapped at a fixed width, so the output does not depend on the terminal.
argparse has no public API for walking a parser; this reads its documented-by-use private
attributes (`_actions`, `_action_groups`, `_choices_actions`, the formatter's
`_format_action_invocation`) and loads lazily built subcommand parsers.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from duplex.frontend.cli import build_parser

WIDTH = 100
DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "cli-reference.md"
REGENERATE = "python -m duplex.frontend.cli_docs > docs/cli-reference.md"


def reference() -> str:
    """The whole Markdown document."""
    parser = build_parser()
    commands = _subcommands(parser)
    lines = ["# `duplex` command reference", "",
             f"<!-- Generated from the argument parser by `{REGENERATE}`; do not edit. -->", "",
             "```text", _usage(parser), "```", ""]
    lines += [f"- [`{sub.prog}`](#{_anchor(sub.prog)}): {_cell(help_text)}"
              for sub, help_text in commands]
    for sub, help_text in commands:
        lines += ["", *_section(sub, help_text)]
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[argparse.ArgumentParser, str]]:
    """(parser, one-line help) of every subcommand below `parser`, depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                _load(sub)
                found.append((sub, helps.get(name) or ""))
                found += _subcommands(sub)
    return found


def _load(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of a lazily built parser (bench's: `module`, `is_loaded`) now;
    a module missing from this build is marked as `duplex` itself marks it."""
    if getattr(parser, "is_loaded", True):
        return
    parser.is_loaded = True
    try:
        importlib.import_module(parser.module).add_arguments(parser)
    except ModuleNotFoundError as e:
        if e.name != parser.module:
            raise
        parser.set_defaults(_missing=parser.module)


def _section(parser: argparse.ArgumentParser, help_text: str) -> list[str]:
    lines = [f"## `{parser.prog}`", ""]
    description = parser.description or help_text
    if description:
        lines += [description.strip(), ""]
    missing = parser.get_default("_missing")
    if missing:
        return lines + [f"*Not available in this build: module `{missing}` is missing.*"]
    lines += ["```text", _usage(parser), "```"]
    for group in parser._action_groups:
        lines += _group_table(group)
    return lines


def _group_table(group: argparse._ArgumentGroup) -> list[str]:
    actions = [a for a in group._group_actions
               if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    if not actions:
        return []
    if all(isinstance(a, argparse._SubParsersAction) for a in actions):
        rows = [(f"`{c.dest}`", "", _cell(c.help or "")) for a in actions
                for c in a._choices_actions]
        header = "| command | | description |"
    else:
        rows = [(f"`{_invocation(a)}`", _default(a), _cell(_help(a))) for a in actions]
        header = "| argument | default | description |"
    return ["", f"**{group.title}**", "", header, "| --- | --- | --- |",
            *(f"| {name} | {default} | {text} |" for name, default, text in rows)]


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _invocation(action: argparse.Action) -> str:
    """`--port PORT`, `-v, --verbose`, `--log-level {debug,info}` or a positional's name."""
    return argparse.HelpFormatter("duplex")._format_action_invocation(action)


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        text = text % {**vars(action), "prog": "duplex"}
    return text


def _default(action: argparse.Action) -> str:
    default = action.default
    if isinstance(action, argparse.BooleanOptionalAction) and isinstance(default, bool):
        return "on" if default else "off"
    if action.nargs == 0 or default in (None, argparse.SUPPRESS, [], ()):
        return ""  # flags (their default is "off") and options without a default
    return _cell(f"`{default}`")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _anchor(title: str) -> str:
    """GitHub's anchor for a `## title` heading."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duplex.frontend.cli_docs", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help=f"compare with {DOC_PATH.name} instead of printing")
    args = parser.parse_args(argv)
    text = reference()
    if not args.check:
        sys.stdout.write(text)
        return 0
    if DOC_PATH.is_file() and DOC_PATH.read_text() == text:
        return 0
    print(f"{DOC_PATH} is stale; regenerate it: {REGENERATE}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""Where a subcommand's settings come from: the command line, DUPLEX_* environment variables,
a config file (`--config FILE`, TOML; YAML too when PyYAML is installed), or the defaults.

Precedence, highest first: CLI > environment > file > default. It works over any
argparse parser, so a flag added later is covered with no extra code:

    flag              --max-queued-requests 64     --api-key A --api-key B   --no-fair-prefill
    environment       DUPLEX_MAX_QUEUED_REQUESTS=64 DUPLEX_API_KEY=A,B      DUPLEX_FAIR_PREFILL=0
    config file       max_queued_requests = 64     api_key = ["A", "B"]     fair_prefill = false

A file key is the flag's long name without the dashes, `-` or `_` alike (vLLM's YAML
style). Values from the environment and files go through the flag's own type and
choices, and a bad one is an error naming where it came from. `--print-config` prints
every setting with its source as TOML (a file `--config` reads back; secrets such as API keys
appear only as a comment), then every DUPLEX_* switch of kernels/switches.py with its value and
source, as comments (they are no settings: environment only), and exits.

How the CLI's share is told apart: the subcommand parses its arguments into a namespace
pre-filled with UNSET (argparse sets a default only for an attribute the namespace lacks),
so whatever is still UNSET afterwards was not on the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "DUPLEX_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NOT_SOURCED = ("config", "print_config")
_SECRET = re.compile(r"(^|_)(api_key|secret|password)s?$")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclasses.dataclass(frozen=True)
class Setting:
    dest: str
    value: Any
    source: str  # cli | env | file | default
    origin: str  # the flag, variable or file key it came from


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings sources")
    group.add_argument("--config", metavar="FILE", default=None,
                       help="read settings from this TOML (or YAML) file; precedence: flags > "
                            f"{ENV_PREFIX}* environment variables > this file > defaults")
    group.add_argument("--print-config", action="store_true",
                       help="print every setting with where it came from, then exit")


def parse(parser: argparse.ArgumentParser, argv: list[str],
          environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse `argv` with `parser` and fill what it leaves unset from env, file, defaults."""
    environ = os.environ if environ is None else environ
    actions = _sourced_actions(parser)
    namespace = argparse.Namespace(**{a.dest: _unset_for(a) for a in actions})
    args = parser.parse_args(argv, namespace)
    config_path = args.config if args.config is not None else environ.get(ENV_PREFIX + "CONFIG")
    from_file = _read_file(parser, actions, config_path) if config_path else {}
    settings = []
    for action in actions:
        settings.append(_resolve(parser, action, getattr(args, action.dest), environ, from_file,
                                 config_path))
        setattr(args, action.dest, settings[-1].value)
    args.config = config_path
    args.settings = settings
    return args


def print_config(args: argparse.Namespace, out=None) -> None:
    """Every setting as `key = value  # source (origin)`, TOML that --config reads back."""
    out = out or sys.stdout
    for s in args.settings:
        if _SECRET.search(s.dest) and s.value:  # a comment: read back, it keeps its source
            n = len(s.value) if isinstance(s.value, list) else 1
            count = f"{n} value{'s' if n != 1 else ''}"
            print(f"# {s.dest} = ({count}, hidden)  # {s.source} ({s.origin})", file=out)
        elif s.value is None:
            print(f"# {s.dest} = (unset)  # {s.source}", file=out)
        else:
            print(f"{s.dest} = {_toml(s.value)}  # {s.source} ({s.origin})", file=out)
    print_switches(out)


def print_switches(out=None) -> None:
    """Every kernels.switches switch as a TOML comment: value, source, kind and meaning."""
    from duplex.kernels import switches

    out = out or sys.stdout
    print("# switches (environment variables only; kernels/switches.py):", file=out)
    for switch in switches.SWITCHES:
        print(f"# {switch.name} = {_toml(switches.value(switch.name))}  # "
              f"{switches.source(switch.name)} ({switch.kind}: {switch.help})", file=out)


def override(args: argparse.Namespace, dest: str, value, source: str, origin: str) -> None:
    """Record a value a subcommand derived itself (e.g. a positional standing for a flag)."""
    setattr(args, dest, value)
    args.settings = [Setting(dest, value, source, origin) if s.dest == dest else s
                     for s in getattr(args, "settings", [])]


def env_names(action: argparse.Action) -> list[str]:
    return [ENV_PREFIX + name.upper().replace("-", "_") for name in _long_names(action)]


# ------------------------------------------------------------------ internals
def _sourced_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Options that take a value or a switch; not help, version, positionals, subcommands."""
    skipped = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return [a for a in parser._actions
            if a.option_strings and not isinstance(a, skipped) and a.dest not in _NOT_SOURCED]


def _unset_for(action: argparse.Action):
    # append actions copy what the namespace holds; None reads as "nothing appended yet"
    return None if isinstance(action, argparse._AppendAction) else UNSET


def _was_given(action: argparse.Action, value) -> bool:
    if isinstance(action, argparse._AppendAction):
        return value is not None
    return value is not UNSET


def _resolve(parser, action, cli_value, environ, from_file, config_path) -> Setting:
    flag = "--" + _long_name(action)
    if _was_given(action, cli_value):
        return Setting(action.dest, cli_value, "cli", flag)
    for name in env_names(action):  # every long spelling: DUPLEX_WEIGHTS_DTYPE, DUPLEX_DTYPE
        if name in environ:
            return Setting(action.dest, _convert(parser, action, environ[name], name), "env",
                           name)
    if action.dest in from_file:
        key, raw = from_file[action.dest]
        return Setting(action.dest, _convert(parser, action, raw, f"{config_path}: {key}"),
                       "file", key)
    default = action.default
    if isinstance(action, argparse._AppendAction):
        default = list(default) if default else []
    elif isinstance(default, str) and action.type is not None:
        default = action.type(default)  # as argparse itself does for string defaults
    return Setting(action.dest, default, "default", flag)


def _convert(parser, action, raw, where: str):
    """A value from the environment or a file, through the flag's type and choices."""
    try:
        if isinstance(action, argparse._AppendAction):
            items = raw.split(",") if isinstance(raw, str) else raw
            if not isinstance(items, list):
                raise ValueError("expected a list")
            return [_scalar(action, item) for item in items if item != ""]
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            return _boolean(raw)
        return _scalar(action, raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        parser.error(f"{where}: bad value {raw!r} for {action.option_strings[-1]}: {e}")


def _scalar(action, raw):
    if isinstance(raw, bool) or (raw is not None and not isinstance(raw, (str, int, float))):
        raise ValueError("expected a single value")
    value = action.type(raw if isinstance(raw, str) else raw) if action.type else str(raw)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"choose from {', '.join(map(str, action.choices))}")
    return value


def _boolean(raw) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected true or false")


def _read_file(parser, actions, path: str) -> dict[str, tuple[str, Any]]:
    """{dest: (key as written, value)} from a TOML or YAML file; unknown keys are an error."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as e:
        parser.error(f"--config {path}: {e.strerror or e}")
    try:
        data = _load_yaml(text) if file.suffix in (".yaml", ".yml") else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as e:
        parser.error(f"--config {path}: cannot parse it: {e}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a table of settings")
    by_name = {name.replace("-", "_"): a for a in actions for name in _long_names(a)}
    by_name.update({a.dest: a for a in actions})
    found, unknown = {}, []
    for key, value in data.items():
        action = by_name.get(str(key).replace("-", "_"))
        if action is None:
            unknown.append(str(key))
        else:
            found[action.dest] = (str(key), value)
    if unknown:
        parser.error(f"--config {path}: unknown settings: {', '.join(sorted(unknown))}")
    return found


def _load_yaml(text: str):
    try:
        import yaml
    except ModuleNotFoundError:
        raise ValueError("YAML needs PyYAML (pip install pyyaml); or write the file as TOML") \
            from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def _long_names(action: argparse.Action) -> list[str]:
    """The flag's long spellings without dashes (`--max-n` -> `max-n`), the first first."""
    long = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
    return [o.lstrip("-") for o in long or action.option_strings[:1]]


def _long_name(action: argparse.Action) -> str:
    return _long_names(action)[0]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string

"""Structured output and tool-call constraints: API fields -> one engine `Constraint`.

Owns the mapping from what clients send to what the engine enforces (engine/grammar.py):

* OpenAI `response_format`: `json_object`, `json_schema` (strict or not: the schema is
  enforced either way), `text` (none); Anthropic `output_config.format` (a JSON schema);
* vLLM's extras, by the names vLLM users know: `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar` and `structured_outputs` {json, regex, choice, grammar,
  json_object, structural_tag};
* tool calls (tool_parser.ToolFormat says how a call is written): `tool_choice` required /
  named (Anthropic any / tool) must produce calls of offered tools whose arguments match
  their schemas; `auto` lets free text run until the call trigger, after which the call is
  constrained. A named choice means exactly one call; required / auto allow more only with
  parallel calls on (OpenAI `parallel_tool_calls`, default true; Anthropic
  `disable_parallel_tool_use`). After the last allowed call the grammar is complete, so
  the only token left is end of output: a model cannot repeat the call until max_tokens.

Every constraint is parsed by the grammar engine here, off the event loop and within a time
limit, so a malformed or unsupported schema, regex or grammar is a 400 naming its field
before anything reaches a worker. More than one constraint in a request is a 400 too.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, NamedTuple

from duplex.engine.grammar import GrammarError, MAX_SPEC_BYTES, choice_tag, parse
from duplex.engine.sampling_params import Constraint
from duplex.frontend.errors import invalid

PARSE_TIMEOUT_S = 5.0
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema (objects and arrays)
# Free whitespace inside constrained JSON (tool arguments): one character at a time, or a
# small model pads forever (engine/grammar.py bans control bytes but "\n" in tool calls).
MAX_WHITESPACE = 1


class Requested(NamedTuple):
    """A constraint and the request field that asked for it (named in errors)."""
    constraint: Constraint
    param: str


def from_openai(body) -> Requested | None:
    """The output constraint an OpenAI chat or completion body asks for, if any."""
    found = [r for r in (_response_format(getattr(body, "response_format", None)),
                         *_guided(body), _structured_outputs(body.structured_outputs))
             if r is not None]
    if len(found) > 1:
        raise invalid(f"{found[0].param} and {found[1].param} both constrain the output; "
                      "give one", param=found[1].param)
    return found[0] if found else None


def from_anthropic(output_config: dict | None) -> Requested | None:
    """The output constraint of an Anthropic `output_config`: its `format`, a JSON schema
    (`{"type": "json_schema", "schema": {...}}`, what the SDK's `messages.parse(output_format=
    ...)` sends); `effort` is a hint this server does not use."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid("output_config.format.type must be 'json_schema'",
                      param="output_config.format.type")
    if fmt.get("schema") is None:
        raise invalid("output_config.format.schema is missing: a json_schema format needs one",
                      param="output_config.format.schema")
    return Requested(_schema(fmt["schema"], "output_config.format.schema"),
                     "output_config.format.schema")


def _response_format(fmt) -> Requested | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Requested(Constraint("json_object"), "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise invalid("response_format json_schema needs json_schema.schema",
                      param="response_format.json_schema")
    return Requested(_schema(fmt.json_schema.schema_, "response_format.json_schema.schema"),
                     "response_format.json_schema.schema")


def _guided(body) -> list[Requested | None]:
    out = []
    if body.guided_json is not None:
        out.append(Requested(_schema(body.guided_json, "guided_json"), "guided_json"))
    if body.guided_regex is not None:
        out.append(Requested(Constraint("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        out.append(Requested(_choice(body.guided_choice, "guided_choice"), "guided_choice"))
    if body.guided_grammar is not None:
        out.append(Requested(Constraint("grammar", body.guided_grammar), "guided_grammar"))
    return out


def _structured_outputs(so) -> Requested | None:
    if so is None:
        return None
    given = [(name, getattr(so, name)) for name in
             ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
             if getattr(so, name) not in (None, False)]
    if len(given) != 1:
        raise invalid("structured_outputs must set exactly one of json, regex, choice, "
                      "grammar, json_object, structural_tag", param="structured_outputs")
    name, value = given[0]
    param = f"structured_outputs.{name}"
    if name == "json":
        return Requested(_schema(value, param), param)
    if name == "choice":
        return Requested(_choice(value, param), param)
    if name == "json_object":
        return Requested(Constraint("json_object"), param)
    if name == "structural_tag":
        text = value if isinstance(value, str) else json.dumps(value)
        return Requested(Constraint("structural_tag", text), param)
    return Requested(Constraint(name, value), param)


def _schema(schema: Any, param: str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise invalid(f"{param} is not valid JSON", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"{param} must be a JSON schema object", param=param)
    _check_depth(schema, param)
    return Constraint("json_schema", json.dumps(schema))


def _choice(choices: Any, param: str) -> Constraint:
    try:
        choice_tag(choices)  # checks the list
    except GrammarError as e:
        raise invalid(f"{param}: {e}", param=param) from None
    return Constraint("choice", json.dumps(choices))


def _check_depth(value: Any, param: str, depth: int = 0) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise invalid(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
    children = value.values() if isinstance(value, dict) else \
        value if isinstance(value, list) else ()
    for child in children:
        _check_depth(child, param, depth + 1)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI logit_bias ({"token id": bias in [-100, 100]}) -> {token id: bias}."""
    if not bias:
        return {}
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 9:
            raise invalid(f"logit_bias key {key!r} is not a token id of this model",
                          param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise invalid(f"logit_bias[{key!r}] must be in [-100, 100], got {value}",
                          param="logit_bias")
        out[int(key)] = float(value)
    return out


# ---------------------------------------------------------------- tool calls
def for_chat(requested: Requested | None, tools: list[dict] | None, fmt, choice: str | None,
             parallel: bool, forced: str = "") -> Requested | None:
    """The constraint of a chat request: its output constraint (`requested`) and its
    tool_choice over OpenAI-shaped tools ({"function": {...}}) written in the tool-call
    format `fmt` (engine/text/tool_formats.py). choice: "auto", "required", a tool name, or
    None / "none" (no tool constraint). forced: the start of a call the prompt already
    holds (required / named, see tool_parser.forced_call_prefix); the constraint continues
    after it. With auto, an output constraint means: that output, or tool calls."""
    if not tools or choice in (None, "none"):
        return requested
    if not fmt.can_constrain:
        if choice != "auto":
            raise invalid(f"tool_choice {choice!r} needs a tool-call format that can be "
                          f"constrained; the server's --tool-call-parser {fmt.name} cannot",
                          param="tool_choice")
        return requested  # auto: calls are parsed, not constrained
    functions = [t["function"] for t in tools]
    if choice not in ("auto", "required"):  # named: that tool, once
        functions = [f for f in functions if f["name"] == choice]
        parallel = False
    tags = [fmt.tag(f["name"], _arguments_schema(f)) for f in functions]
    if requested is not None:
        if choice != "auto":
            raise invalid(f"{requested.param} and tool_choice {choice!r} contradict each other: "
                          "a required tool call cannot also be that output",
                          param=requested.param)
        either = {"type": "or", "elements": [
            as_format(requested.constraint), _calls(tags, fmt, True, parallel)]}
        return Requested(_tag(either), requested.param)
    calls = _after_forced(tags, fmt, forced, parallel) if forced else \
        _calls(tags, fmt, at_least_one=choice != "auto", parallel=parallel)
    return Requested(_tag(calls), "tool_choice")


def as_format(constraint: Constraint) -> dict:
    """A constraint as one element of a structural tag."""
    kind, spec = constraint.kind, constraint.spec
    if kind in ("json_object", "json_schema"):
        schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
        return {"type": "json_schema", "json_schema": schema,
                "max_whitespace_cnt": MAX_WHITESPACE}
    if kind == "regex":
        return {"type": "regex", "pattern": spec}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec}
    if kind == "choice":
        return json.loads(choice_tag(json.loads(spec)))["format"]
    return json.loads(spec).get("format", {})


def _tag(fmt: dict) -> Constraint:
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def _arguments_schema(function: dict) -> dict:
    return {"type": "json_schema", "json_schema": function.get("parameters") or
            {"type": "object"}, "max_whitespace_cnt": MAX_WHITESPACE}


def _calls(tags: list[dict], fmt, at_least_one: bool, parallel: bool) -> dict:
    if not at_least_one:  # auto: text until the trigger, then a call
        return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                "stop_after_first": not parallel}
    return {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
            "at_least_one": True, "stop_after_first": not parallel}


def _after_forced(tags: list[dict], fmt, forced: str, parallel: bool) -> dict:
    """What may follow `forced` (a prefix of one or more tags' begin): the rest of one
    of those calls, then (parallel) more calls."""
    firsts = [{"type": "sequence", "elements": [
        {"type": "const_string", "value": tag["begin"][len(forced):]} if
        len(tag["begin"]) > len(forced) else None, tag["content"],
        {"type": "const_string", "value": tag["end"]}]} for tag in tags
        if tag["begin"].startswith(forced)]
    for first in firsts:
        first["elements"] = [e for e in first["elements"] if e is not None]
    first = firsts[0] if len(firsts) == 1 else {"type": "or", "elements": firsts}
    if not parallel:
        return first
    more = {"type": "sequence", "elements": [
        {"type": "const_string", "value": fmt.separator},
        {"type": "or", "elements": tags} if len(tags) > 1 else tags[0]]}
    return {"type": "sequence", "elements": [first, {"type": "star", "content": more}]}


# ---------------------------------------------------------------- checking
async def check(constraint: Constraint | None, param: str) -> None:
    """Parse the constraint with the grammar engine off the event loop, within
    PARSE_TIMEOUT_S; a 400 naming `param` when it cannot be enforced."""
    if constraint is None:
        return
    if len(constraint.spec.encode()) > MAX_SPEC_BYTES:
        raise invalid(f"{param} is larger than {MAX_SPEC_BYTES} bytes", param=param)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.run_in_executor(None, parse, constraint), PARSE_TIMEOUT_S)
    except GrammarError as e:
        raise invalid(f"{param}: {e}", param=param) from None
    except TimeoutError:
        raise invalid(f"{param} is too complex: the grammar engine did not accept it within "
                      f"{PARSE_TIMEOUT_S:.0f} s", param=param) from None

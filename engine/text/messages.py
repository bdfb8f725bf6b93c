"""The normalized chat: the one form of messages and tools the recipe renders.

Owns: what a valid message and tool definition is, and the `Chat` that carries them to
engine/text/recipe.py. A normalized message is a plain JSON-typed dict (what a chat template
reads, so a key it lacks stays undefined to the template):

    {"role": "system" | "user" | "assistant" | "tool",   # developer is system
     "content": str,                                     # text parts joined with newlines
     "name"?, "tool_call_id"?: str,
     "tool_calls"?: [{"id"?: str, "type": "function",
                      "function": {"name": str, "arguments": dict | str}}],  # a dict when
                                                         # the arguments are a JSON object
     "thinking"?, "reasoning_content"?, "reasoning"?: str}

and a tool is `{"type": "function", "function": {"name": str, "description"?: str,
"parameters"?: dict}}`. Two ways in, one validation each:

* `Chat.from_dicts(messages, tools)`: plain dicts from a user (the offline API, the Responses
  API's untyped items) are validated here (`normalize_messages`, `normalize_tools`; keys
  keep the client's order, as templates may iterate or dump them);
* `message`, `tool_call`, `tool`: built from typed API structs the frontend already validated
  while decoding them (frontend/protocol.py), so they only build.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

from duplex.engine.text.errors import RecipeError, short

ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant", "tool": "tool"}
_MAX_JSON_DEPTH = 64
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class Chat(NamedTuple):
    """A conversation in the normalized form (module docstring); the only input the recipe
    renders."""
    messages: list[dict]
    tools: list[dict] | None = None

    @classmethod
    def from_dicts(cls, messages: Any, tools: Any = None) -> Chat:
        """Validated from OpenAI-style plain dicts; a RecipeError names what is wrong."""
        return cls(normalize_messages(messages), normalize_tools(tools))


def message(role: str, content: str | None, *, name: str | None = None,
            tool_calls: list[dict] | None = None, tool_call_id: str | None = None,
            reasoning: str | None = None) -> dict:
    """A normalized message from already-typed fields (`role` one of ROLES; `tool_calls`
    built with `tool_call`; `reasoning`: an assistant turn's thinking, under both names
    templates read)."""
    out: dict = {"role": ROLES[role], "content": content or ""}
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    if name is not None:
        out["name"] = name
    if tool_calls:
        out["tool_calls"] = tool_calls
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


def tool_call(name: str, arguments: str | dict, call_id: str | None = None) -> dict:
    """A normalized tool call; `arguments` as JSON text (kept as text unless it is an
    object) or an already-decoded JSON object."""
    out: dict = {} if call_id is None else {"id": call_id}
    parsed = arguments if isinstance(arguments, dict) else _parsed_object(arguments)
    return {**out, "type": "function", "function": {"name": name, "arguments": parsed}}


def tool(function: dict) -> dict:
    """A normalized tool from a function definition of JSON values (name, description,
    parameters, in the order its API gives them)."""
    return {"type": "function", "function": function}


def normalize_messages(messages: Any) -> list[dict]:
    """Validated copies of OpenAI-style messages, content flattened to one string."""
    if not isinstance(messages, list) or not messages:
        raise RecipeError("messages must be a non-empty list")
    return [_normalize_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _normalize_message(where: str, message: Any) -> dict:
    if not isinstance(message, dict):
        raise RecipeError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise RecipeError(f"{where}.role must be one of {sorted(ROLES)}, got {short(role)}")
    tool_calls = message.get("tool_calls")
    content = message.get("content")
    if content is None and not (role == "assistant" and tool_calls):
        raise RecipeError(f"{where}.content is required")
    out = {"role": ROLES[role], "content": _text_content(where, content or "")}
    for key in ("name", "tool_call_id", *_REASONING_KEYS):
        if message.get(key) is not None:
            out[key] = _string(f"{where}.{key}", message[key])
    if tool_calls:
        if role != "assistant":
            raise RecipeError(f"{where}.tool_calls is only allowed on assistant messages")
        if not isinstance(tool_calls, list):
            raise RecipeError(f"{where}.tool_calls must be a list")
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", call)
                             for j, call in enumerate(tool_calls)]
    out = _in_order_of(message, out)
    reasoning = next((out[key] for key in _REASONING_KEYS if key in out), None)
    if reasoning is not None:   # as transformers does: templates read one name or the other
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _in_order_of(original: dict, normalized: dict) -> dict:
    """`normalized` with keys in the client's order (templates may iterate or dump them)."""
    order = [key for key in original if key in normalized]
    order += [key for key in normalized if key not in original]
    return {key: normalized[key] for key in order}


def _text_content(where: str, content: Any) -> str:
    """A string, or a list of `{"type": "text", "text": ...}` parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecipeError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RecipeError(f"{where}.content[{j}] must be an object")
        if part.get("type") != "text":
            raise RecipeError(f"{where}.content[{j}] has type {short(part.get('type'))}: "
                              "only text parts are supported (this model reads text only)")
        texts.append(_string(f"{where}.content[{j}].text", part.get("text")))
    return "\n".join(texts)


def _tool_call(where: str, call: Any) -> dict:
    if not isinstance(call, dict):
        raise RecipeError(f"{where} must be an object")
    if call.get("type", "function") != "function":
        raise RecipeError(f"{where}.type must be 'function'")
    function = call.get("function")
    if not isinstance(function, dict):
        raise RecipeError(f"{where}.function must be an object")
    out = {"type": "function"}
    if call.get("id") is not None:
        out["id"] = _string(f"{where}.id", call["id"])
    name = _string(f"{where}.function.name", function.get("name"))
    arguments = _arguments(f"{where}.function.arguments", function.get("arguments", "{}"))
    out["function"] = _in_order_of(function, {"name": name, "arguments": arguments})
    return _in_order_of(call, out)


def _arguments(where: str, arguments: Any) -> Any:
    """Arguments as a dict when they are a JSON object (templates expect one), else the string."""
    if isinstance(arguments, dict):
        return _json_value(where, arguments)
    return _parsed_object(_string(where, arguments))


def _parsed_object(arguments: str) -> dict | str:
    """JSON text as a dict when it is an object, else the text itself."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # nested past the parser's depth: keep the text
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def normalize_tools(tools: Any) -> list[dict] | None:
    """Validated copies of OpenAI-style tool definitions (`{"type": "function", ...}`)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RecipeError("tools must be a list")
    return [_tool(f"tools[{i}]", tool) for i, tool in enumerate(tools)]


def _tool(where: str, tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RecipeError(f"{where} must be an object with type 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RecipeError(f"{where}.function must be an object")
    _string(f"{where}.function.name", function.get("name"))
    if function.get("description") is not None:
        _string(f"{where}.function.description", function["description"])
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise RecipeError(f"{where}.function.parameters must be an object")
    return _in_order_of(tool, {"type": "function", **_json_value(where, tool)})


def _json_value(where: str, value: Any, depth: int = 0) -> Any:
    """A copy of a JSON value (str keys, JSON scalars), at most _MAX_JSON_DEPTH deep."""
    if depth > _MAX_JSON_DEPTH:
        raise RecipeError(f"{where} is nested too deeply")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise RecipeError(f"{where} has a non-string key")
        return {key: _json_value(f"{where}.{key}", item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_value(f"{where}[{i}]", item, depth + 1) for i, item in enumerate(value)]
    raise RecipeError(f"{where} must be JSON, got {type(value).__name__}")


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise RecipeError(f"{where} must be a string, got {type(value).__name__}")
    return value


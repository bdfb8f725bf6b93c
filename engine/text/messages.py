"""Chat message validation: OpenAI-shaped dicts in, plain JSON-typed dicts out.

Owns: what a valid message and tool definition is. The output is what the recipe renders
(engine/text/recipe.py): roles mapped to the template's four, content flattened to one string,
tool-call arguments parsed into a dict when they are a JSON object, keys in the client's order.
"""
from __future__ import annotations

import json
from typing import Any

from engine.text.errors import RecipeError, short

ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant", "tool": "tool"}
_MAX_JSON_DEPTH = 64
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


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
    arguments = _string(where, arguments)
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


"""OpenAI-shaped chat messages and tools -> the normalized chat (engine/text/messages.py).

Chat completions, /tokenize and the WebSocket all take OpenAI's message shape (`ChatMessage`
structs from `protocol`); the conversion lives here, once, so no API module borrows another's.
"""
from __future__ import annotations

from duplex.engine.text import messages as normalized
from duplex.frontend.errors import invalid
from duplex.frontend.protocol import ChatMessage, Tool


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> normalized messages (engine/text/messages.py), straight from the
    decoded structs: what their types do not say is checked here, once."""
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: ChatMessage, where: str) -> dict:
    content = _content_text(m.content, f"{where}.content")
    if content is None and not (m.role == "assistant" and m.tool_calls):
        raise invalid(f"{where}.content is required for role {m.role!r}",
                      param=f"{where}.content")
    if m.tool_calls and m.role != "assistant":
        raise invalid(f"{where}.tool_calls is only allowed on assistant messages",
                      param=f"{where}.tool_calls")
    calls = [normalized.tool_call(c.function.name, c.function.arguments, c.id)
             for c in m.tool_calls or []]
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None and m.role != "assistant":
        raise invalid(f"{where}.reasoning_content is only allowed on assistant messages",
                      param=f"{where}.reasoning_content")
    return normalized.message(m.role, content, name=m.name or None, tool_calls=calls,
                              tool_call_id=m.tool_call_id, reasoning=reasoning)


def _content_text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(f"{where}[{i}]: only text content parts are supported, got "
                          f"{part.type!r}", param=f"{where}[{i}].type")
        texts.append(part.text)
    return "\n".join(texts)


def tool_dict(tool: Tool) -> dict:
    """An OpenAI tool -> a normalized tool (parameters default to an empty object)."""
    fn = tool.function
    function: dict = {"name": fn.name}
    if fn.description is not None:
        function["description"] = fn.description
    function["parameters"] = fn.parameters if fn.parameters is not None else {
        "type": "object", "properties": {}}
    return normalized.tool(function)

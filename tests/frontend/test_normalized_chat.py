"""The frontend builds the normalized chat (engine/text/messages.py) straight from its decoded
API structs, and it is the very form the validating path makes of the same conversation as
plain dicts (key order included: templates may dump a message), so both render the same."""
from __future__ import annotations

import msgspec

from duplex.engine.text.messages import Chat
from duplex.frontend import anthropic_api, openai_api
from duplex.frontend.protocol import ChatCompletionRequest, MessagesRequest

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
OPENAI_MESSAGES = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
     "name": "bob"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[1]"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "f", "description": "d",
                                                  "parameters": {"type": "object"}}}]


def _openai_chat(body: dict) -> Chat:
    request = msgspec.convert(body, ChatCompletionRequest)
    tools = [openai_api.tool_dict(t) for t in request.tools] if request.tools else None
    return Chat(openai_api.chat_messages(request.messages), tools)


def test_openai_structs_make_the_form_the_dict_path_makes():
    chat = _openai_chat({"messages": OPENAI_MESSAGES, "tools": OPENAI_TOOLS})
    assert chat == Chat.from_dicts(OPENAI_MESSAGES, OPENAI_TOOLS)
    assert [list(m) for m in chat.messages] == [
        list(m) for m in Chat.from_dicts(OPENAI_MESSAGES).messages]
    assert chat.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert chat.messages[3]["tool_calls"][0]["function"]["arguments"] == "[1]"


def test_anthropic_structs_make_the_form_the_dict_path_makes():
    request = msgspec.convert({"max_tokens": 5, "system": "be brief", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "checking"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
            {"type": "text", "text": "thanks"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, MessagesRequest)
    chat = Chat(anthropic_api.chat_messages(request),
                [anthropic_api.tool_dict(t) for t in request.tools])
    assert chat == Chat.from_dicts([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
        {"role": "user", "content": "thanks"},
    ], [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])

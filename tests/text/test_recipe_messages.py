"""Message and tool validation: malformed input is a RecipeError (a ValueError) naming it."""
import pytest

from duplex.engine.text.errors import RecipeError
from duplex.engine.text.messages import Chat, normalize_messages, normalize_tools
from recipe_factories import tool_call, user

BAD_MESSAGES = [
    (None, "non-empty list"),
    ([], "non-empty list"),
    ({"role": "user", "content": "hi"}, "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "wizard", "content": "hi"}], r"role must be one of"),
    ([{"role": "user"}], r"content is required"),
    ([{"role": "user", "content": 3}], r"content must be a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"content\[0\] has type 'image_url': only text parts"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "only text parts"),
    ([{"role": "user", "content": ["text"]}], r"content\[0\] must be an object"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be a string"),
    ([{"role": "user", "content": "hi", "name": 5}], r"\.name must be a string"),
    ([{"role": "tool", "content": "hi", "tool_call_id": ["x"]}], r"tool_call_id must be"),
    ([{"role": "user", "content": "hi", "tool_calls": [tool_call("f", {})]}],
     "only allowed on assistant"),
    ([{"role": "assistant", "content": None, "tool_calls": {"a": 1}}], "must be a list"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"type": "code"}]}],
     r"type must be 'function'"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}],
     r"function must be an object"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     r"function\.name must be a string"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": 3}}]}], r"arguments must be a string"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": {1, 2}}}}]}], "must be JSON"),
]


@pytest.mark.parametrize("messages, message", BAD_MESSAGES)
def test_bad_messages(messages, message):
    with pytest.raises(RecipeError, match=message):
        normalize_messages(messages)
    assert issubclass(RecipeError, ValueError)


def test_recipe_rejects_bad_messages(default_recipe):
    with pytest.raises(ValueError, match="only text parts"):
        default_recipe.encode_chat(
            Chat.from_dicts([{"role": "user", "content": [{"type": "image_url"}]}]))


BAD_TOOLS = [
    ({"type": "function"}, "tools must be a list"),
    ([{"type": "retrieval"}], r"tools\[0\] must be an object with type 'function'"),
    (["f"], r"tools\[0\] must be an object"),
    ([{"type": "function"}], r"function must be an object"),
    ([{"type": "function", "function": {"name": 1}}], r"function\.name must be a string"),
    ([{"type": "function", "function": {"name": "f", "description": 2}}], "description"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {1: "x"}}}], "non-string key"),
]


@pytest.mark.parametrize("tools, message", BAD_TOOLS)
def test_bad_tools(tools, message):
    with pytest.raises(RecipeError, match=message):
        normalize_tools(tools)


def test_deep_nesting_is_refused():
    deep = {}
    node = deep
    for _ in range(100):
        node["a"] = {}
        node = node["a"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    with pytest.raises(RecipeError, match="nested too deeply"):
        normalize_tools(tools)


def test_normalized_shape():
    messages = normalize_messages([
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"tool_calls": [tool_call("f", {"x": 1})], "role": "assistant", "content": None,
         "refusal": None, "audio": {"id": "ignored"}},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok", "name": "f"},
        user("hi", name="bob"),
    ])
    assert messages == [
        {"role": "system", "content": "a\nb"},
        {"tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": {"x": 1}}}],
         "role": "assistant", "content": ""},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok", "name": "f"},
        {"role": "user", "content": "hi", "name": "bob"},
    ]
    assert list(messages[1]) == ["tool_calls", "role", "content"]   # the client's key order


def test_arguments_that_are_not_a_json_object_stay_strings():
    calls = [{"function": {"name": "f", "arguments": "not json"}},
             {"function": {"name": "g", "arguments": "[1, 2]"}},
             {"function": {"name": "h"}}]
    (message,) = normalize_messages([{"role": "assistant", "content": "", "tool_calls": calls}])
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ["not json", "[1, 2]", {}]

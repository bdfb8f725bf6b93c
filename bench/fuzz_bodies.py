"""Hypothesis strategies of request bodies for every JSON endpoint, mostly valid, sometimes
any JSON, sometimes deeply nested: shared by the bounded fuzz run in `make test`
(tests/frontend/test_fuzz.py) and the long one, `duplex bench fuzz` (bench/fuzz.py)."""
from __future__ import annotations

import json

from hypothesis import strategies as st

json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                          max_leaves=12)
def mostly(valid):
    """Valid seven times in eight, any JSON value otherwise."""
    return st.integers(0, 7).flatmap(lambda i: json_value if i == 3 else valid)


text = st.text(max_size=12)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "user", "wizard"])
content = mostly(text | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image_url"]), "text": text}), max_size=2))
tool_call = st.fixed_dictionaries({"id": text, "type": st.just("function"), "function":
                                   st.fixed_dictionaries({"name": text, "arguments": text})})
message = st.fixed_dictionaries({"role": roles, "content": content}, optional={
    "tool_call_id": mostly(text), "name": mostly(text),
    "tool_calls": mostly(st.lists(tool_call, max_size=1))})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": text}, optional={"description": text, "parameters": st.just({"type": "object"})})})
sampling = {
    "max_tokens": mostly(st.integers(1, 30)), "temperature": mostly(st.floats(0, 2)),
    "top_p": mostly(st.floats(0.01, 1)), "top_k": mostly(st.integers(-1, 50)),
    "min_p": mostly(st.floats(0, 1)), "seed": mostly(st.integers(0, 2**40)),
    "n": mostly(st.integers(1, 3)),
    "stop": mostly(st.text(min_size=1, max_size=3)
                   | st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "presence_penalty": mostly(st.floats(-2, 2)), "repetition_penalty": mostly(st.floats(0, 2)),
    "stream": mostly(st.booleans()), "ignore_eos": mostly(st.booleans()),
    "retention": st.sampled_from(["chat", "agent", "x"])}
chat_body = st.fixed_dictionaries({"messages": mostly(st.lists(message, min_size=1,
                                                               max_size=3))}, optional={
    **sampling, "model": st.sampled_from(["fake-model", "x"]),
    "logprobs": mostly(st.booleans()), "top_logprobs": mostly(st.integers(0, 5)),
    "max_completion_tokens": mostly(st.integers(1, 30)),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "tools": mostly(st.lists(tool, max_size=2)),
    "tool_choice": mostly(st.sampled_from(["none", "auto", "required"]))})
completion_body = st.fixed_dictionaries({"prompt": mostly(
    text | st.lists(st.integers(0, 300), min_size=1, max_size=4)
    | st.lists(text, min_size=1, max_size=3))}, optional={
    **sampling, "echo": mostly(st.booleans()), "logprobs": mostly(st.integers(0, 5)),
    "suffix": st.none() | text})
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": mostly(text)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text,
                           "input": mostly(st.dictionaries(text, text, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text},
                          optional={"content": mostly(text)}),
    st.fixed_dictionaries({"type": text}, optional={"source": json_value}))
anthropic_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "user", "x"]),
    "content": mostly(text | st.lists(block, min_size=1, max_size=2))})
anthropic_tool = st.fixed_dictionaries({"name": text, "input_schema": st.just(
    {"type": "object"})}, optional={"description": text})
messages_body = st.fixed_dictionaries({
    "messages": mostly(st.lists(anthropic_message, min_size=1, max_size=3)),
    "max_tokens": mostly(st.integers(1, 30))}, optional={
    "system": mostly(text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                            "text": text}), max_size=2)),
    "stop_sequences": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "temperature": mostly(st.floats(0, 1)), "top_k": mostly(st.integers(0, 10)),
    "stream": mostly(st.booleans()), "tools": mostly(st.lists(anthropic_tool, max_size=2)),
    "tool_choice": mostly(st.fixed_dictionaries({"type": st.sampled_from(
        ["auto", "any", "none", "tool"])}, optional={"name": text})),
    "model": st.sampled_from(["fake-model", "fake-model", "claude"])})
raw_body = st.binary(max_size=40) | json_value.map(lambda v: json.dumps(v).encode())


def nested(depth: int) -> str:
    """Arrays and objects alternating, `depth` levels deep."""
    half = depth // 2
    return '[{"a":' * half + "1" + "}]" * half


# Deep nesting, as a whole body or inside a field each API takes as free JSON.
deep_body = st.integers(1, 6).flatmap(lambda exponent: st.sampled_from([
    nested(10 ** exponent).encode(),
    ('{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"metadata":{"x":%s}}'
     % nested(10 ** exponent)).encode()]))

BODIES = {"/v1/chat/completions": chat_body, "/v1/completions": completion_body,
          "/v1/messages": messages_body, "/v1/messages/count_tokens": messages_body}
RAW_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize"]


def problem(path: str, status: int, content_type: str, text: str) -> str | None:
    """What is wrong with a response to a fuzzed body, or None: never a 5xx, every error in
    the called API's shape, every stream ended by its terminal event."""
    if status >= 500:
        return f"{status} from {path}: {text[:300]}"
    if status >= 400:
        try:
            error = json.loads(text)
        except ValueError:
            return f"{status} from {path} is not JSON: {text[:300]}"
        if path.startswith("/v1/messages"):
            ok = error.get("type") == "error" and set(error.get("error", {})) == {"type",
                                                                                 "message"}
        else:
            ok = set(error.get("error", {})) == {"message", "type", "param", "code"}
        return None if ok else f"{status} from {path} not in the API's error shape: {text[:300]}"
    if "text/event-stream" in content_type and \
            not text.rstrip().endswith(("data: [DONE]", 'message_stop"}')):
        return f"a stream from {path} did not end with its terminal event"
    return None

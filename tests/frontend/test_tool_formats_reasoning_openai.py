"""Tool calls after a thinking block, through the official `openai` SDK against a local
server: DeepSeek-R1-Distill-Qwen's real template (its tool-call format detected: deepseek_v3)
and Qwen3's (`--tool-call-parser qwen3_coder`), the model's output steered by the scripted
engine (reasoning_support.py). Calls are parsed from the answer only: call markup inside
the thinking stays reasoning."""
from __future__ import annotations

import json

import pytest
from reasoning_support import sdk_servers, openai_sdk

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]

R1_THINKING = "They want Paris. I will write <｜tool▁calls▁begin｜> next."
R1_REPLY = (R1_THINKING + "\n</think>\n\n"
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
QWEN_REPLY = ("<think>\nA call: <tool_call> with <function=get_weather>.\n</think>\n\n"
              "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture
async def serve():
    async with sdk_servers(openai_sdk) as make:
        yield make


async def streamed(sdk) -> tuple[str, str, dict, list[str], str]:
    """(reasoning, content, {index: (name, arguments)}, argument pieces, finish reason)."""
    stream = await sdk.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                               max_tokens=200, stream=True)
    reasoning, content, calls, pieces, finish = [], [], {}, [], None
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                name, arguments = calls.get(delta.index, ("", ""))
                calls[delta.index] = (name + (delta.function.name or ""),
                                      arguments + (delta.function.arguments or ""))
                pieces += [delta.function.arguments] if delta.function.arguments else []
    return "".join(reasoning), "".join(content), calls, pieces, finish


async def test_deepseek_calls_after_thinking_detected_from_the_template(serve, recipes):
    state, sdk = await serve(recipes["r1"], lambda prompt, output: R1_REPLY)
    assert state.options.tool_call_parser == "deepseek_v3"
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                              max_tokens=200)
    message = reply.choices[0].message
    assert message.reasoning_content == R1_THINKING  # its call markup is reasoning
    assert message.content is None
    [call] = message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert reply.choices[0].finish_reason == "tool_calls"


async def test_deepseek_arguments_stream_after_thinking(serve, recipes):
    _, sdk = await serve(recipes["r1"], lambda prompt, output: R1_REPLY)
    reasoning, content, calls, pieces, finish = await streamed(sdk)
    assert (reasoning, content, finish) == (R1_THINKING, "", "tool_calls")
    assert calls == {0: ("get_weather", '{"city": "Paris", "days": 3}')}
    assert len(pieces) > 1  # the arguments came in several deltas, not whole at the end


async def test_qwen3_coder_calls_after_thinking(serve, recipes):
    _, sdk = await serve(recipes["qwen3"], lambda prompt, output: QWEN_REPLY,
                         tool_call_parser="qwen3_coder")
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                              max_tokens=200)
    message = reply.choices[0].message
    assert message.reasoning_content == "A call: <tool_call> with <function=get_weather>."
    assert message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris", "days": 3})]
    reasoning, content, calls, pieces, finish = await streamed(sdk)
    assert (content, finish) == ("", "tool_calls")
    assert reasoning == message.reasoning_content
    assert calls == {0: ("get_weather", '{"city": "Paris", "days": 3}')}
    assert len(pieces) > 1


async def test_qwen3_coder_types_values_by_the_requests_schema(serve, recipes):
    """The request's tools reach the parser: a string parameter that reads as a number stays
    a string, an integer one becomes a number."""
    reply_text = QWEN_REPLY.replace("\nParis\n", "\n1984\n")
    _, sdk = await serve(recipes["qwen3"], lambda prompt, output: reply_text,
                         tool_call_parser="qwen3_coder")
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                              max_tokens=200)
    [call] = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "1984", "days": 3}

"""Structured output and tool calls after a thinking block, through the official `openai` SDK
against a local server: DeepSeek-R1-Distill-Qwen's template (it opens `<think>` in the prompt)
and Qwen3's (the model opens it), the model steered by a script and held to the request's
real grammar (steered_support.py). The constraint holds for the answer, not the thinking:
reasoning_content is free text, content is valid JSON (trailing text the script adds after the
JSON is refused by the grammar), streamed and not, and after a thinking-budget cut."""
from __future__ import annotations

import json

import openai
import pytest
from steered_support import recipe_grammars, start_server

ASK = [{"role": "user", "content": "Which city?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
THINKING = "They ask {which} city; not JSON yet."
ANSWER = '{"city": "Paris"}'
R1_REPLY = THINKING + "\n</think>\n\n" + ANSWER + " and more text"
QWEN_REPLY = "<think>\n" + R1_REPLY


@pytest.fixture(scope="module")
def grammars(recipes):
    return {name: recipe_grammars(recipe) for name, recipe in recipes.items()}


@pytest.fixture
async def serve(recipes, grammars):
    started: list = []

    async def make(name, script, sees_output=False, **options):
        engine, client = await start_server(recipes[name], script, grammars[name], started,
                                            sees_output, **options)
        return engine, openai.AsyncOpenAI(base_url=str(client.make_url("/v1")),
                                          api_key="none", max_retries=0)

    yield make
    for client in started:
        await client.close()


async def test_json_schema_holds_after_the_thinking(serve):
    _, sdk = await serve("r1", lambda prompt: R1_REPLY)
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, max_tokens=80,
                                              response_format=FORMAT)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (THINKING, ANSWER)
    assert reply.choices[0].finish_reason == "stop"


async def test_json_schema_after_the_thinking_streamed(serve):
    _, sdk = await serve("r1", lambda prompt: R1_REPLY)
    stream = await sdk.chat.completions.create(model="fake-model", messages=ASK, max_tokens=80,
                                               response_format=FORMAT, stream=True)
    reasoning, content, finish = [], [], None
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content), finish) == (THINKING, ANSWER, "stop")
    assert len([piece for piece in content if piece]) > 1  # the answer streamed in pieces


def budgeted(prompt: str, output: str) -> str:
    """Thinks forever unless the output already holds a closed block: then the JSON."""
    return ANSWER + " and more" if "</think>" in output else "step " * 60


async def test_the_budget_cut_then_json(serve, recipes):
    engine, sdk = await serve("r1", budgeted, sees_output=True)
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, max_tokens=60,
                                              response_format=FORMAT,
                                              extra_body={"thinking_budget": 5})
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("step step step step step", ANSWER)
    assert reply.choices[0].finish_reason == "stop"
    first, second = engine.added  # the continuation carries the closing marker
    assert second.output_token_ids[-len(recipes["r1"].encode_reply_start("\n</think>\n\n")):] \
        == recipes["r1"].encode_reply_start("\n</think>\n\n")
    assert first.params.constraint.thinking == second.params.constraint.thinking == "open"


async def test_qwen3_model_opens_the_block_then_json(serve):
    engine, sdk = await serve("qwen3", lambda prompt: QWEN_REPLY)
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, max_tokens=80,
                                              response_format=FORMAT)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (THINKING, ANSWER)
    assert engine.added[0].params.constraint.thinking == "may_open"


async def test_qwen3_thinking_off_constrains_from_the_first_token(serve):
    engine, sdk = await serve("qwen3", lambda prompt: ANSWER + " and more")
    reply = await sdk.chat.completions.create(
        model="fake-model", messages=ASK, max_tokens=80, response_format=FORMAT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (None, ANSWER)
    assert engine.added[0].params.constraint.thinking == ""


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
R1_CALL = (THINKING + "\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
           '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
           "<｜tool▁calls▁end｜>")


async def test_a_required_tool_call_after_the_thinking(serve):
    _, sdk = await serve("r1", lambda prompt: R1_CALL)
    reply = await sdk.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                              tool_choice="required", max_tokens=120)
    message = reply.choices[0].message
    assert message.reasoning_content == THINKING
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    assert reply.choices[0].finish_reason == "tool_calls"

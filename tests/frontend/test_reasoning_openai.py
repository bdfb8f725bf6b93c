"""Reasoning in the OpenAI chat API, through the official `openai` SDK: reasoning_content apart
from content (streamed and not), reasoning_tokens, chat_template_kwargs, the thinking budget,
reasoning sent back in history; bad budgets and unknown template keys are 400s."""
from __future__ import annotations

import openai
import pytest
from reasoning_support import sdk_servers, openai_sdk


@pytest.fixture
async def serve():
    async with sdk_servers(openai_sdk) as make:
        yield make


def r1_answer(prompt: str, output: str) -> str:
    return "Two and two.\n</think>\n\nFour."


async def test_r1_reasoning_apart_from_content(serve, recipes):
    state, sdk = await serve(recipes["r1"], r1_answer)
    assert state.reasoning.name == "deepseek_r1"  # detected from the template
    reply = await sdk.chat.completions.create(model="fake-model", messages=[
        {"role": "user", "content": "2+2?"}], max_tokens=50)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("Two and two.", "Four.")
    thinking_ids = recipes["r1"].encode_reply_start("Two and two.\n</think>")
    assert reply.usage.completion_tokens_details.reasoning_tokens == len(thinking_ids)
    assert reply.choices[0].finish_reason == "stop"


async def test_r1_streamed_markers_never_leak(serve, recipes):
    _, sdk = await serve(recipes["r1"], r1_answer)
    stream = await sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "2+2?"}], max_tokens=50,
        stream=True, stream_options={"include_usage": True})
    reasoning, content, usage = [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == ("Two and two.", "Four.")
    assert not any("<" in piece or "think" in piece for piece in reasoning + content)
    assert usage.completion_tokens_details.reasoning_tokens == 6


async def test_never_closed_block_is_all_reasoning_and_length(serve, recipes):
    _, sdk = await serve(recipes["r1"], lambda p, o: "thinking " * 40)
    reply = await sdk.chat.completions.create(model="fake-model", messages=[
        {"role": "user", "content": "hm"}], max_tokens=12)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length"
    assert message.content is None or message.content == ""
    assert message.reasoning_content.startswith("thinking thinking")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 12


def budgeted(prompt: str, output: str) -> str:
    """Thinks forever unless the output already holds a closed block: then answers."""
    return "Answer." if "</think>" in output else "step " * 60


async def test_thinking_budget_closes_the_block_and_the_answer_follows(serve, recipes):
    state, sdk = await serve(recipes["r1"], budgeted)
    reply = await sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "go"}], max_tokens=40,
        extra_body={"thinking_budget": 5})
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("step step step step step",
                                                            "Answer.")
    first, second = state.engine.added
    recipe = recipes["r1"]
    close_ids = recipe.encode_reply_start("\n</think>\n\n")
    step_ids = recipe.encode_reply_start("step " * 60)[:5]
    assert second.output_token_ids == step_ids + close_ids  # the engine continues after them
    assert second.prompt_token_ids == first.prompt_token_ids
    assert second.req_id != first.req_id and first.req_id in state.engine.aborted
    answer_ids = recipe.encode_reply_start("Answer.")
    assert reply.usage.completion_tokens == 5 + len(close_ids) + len(answer_ids)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5


async def test_reasoning_effort_maps_to_a_budget(serve, recipes):
    state, sdk = await serve(recipes["r1"], budgeted)
    reply = await sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "go"}], max_tokens=40,
        reasoning_effort="none")
    assert reply.choices[0].message.reasoning_content == "step"
    assert reply.choices[0].message.content == "Answer."


@pytest.mark.parametrize("extra, field, message", [
    ({"thinking_budget": 0}, "thinking_budget", "thinking_budget must be at least 1, got 0"),
    ({"thinking_budget": 41}, "thinking_budget",
     "thinking_budget is 41, more than max_tokens (40)"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking",
     "chat_template_kwargs.enable_thinking: the chat template reads no variable "
     "'enable_thinking' (it reads bos_token, content)"),
])
async def test_bad_reasoning_fields_are_400s_naming_the_field(serve, recipes, extra, field,
                                                              message):
    _, sdk = await serve(recipes["r1"], budgeted)
    with pytest.raises(openai.BadRequestError) as error:
        await sdk.chat.completions.create(model="fake-model", max_tokens=40, extra_body=extra,
                                          messages=[{"role": "user", "content": "go"}])
    assert error.value.body["param"] == field
    assert error.value.body["message"] == message


async def test_a_budget_for_a_model_without_thinking_is_a_400(make_harness):
    h = await make_harness()
    sdk = openai.AsyncOpenAI(base_url=h.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        await sdk.chat.completions.create(model="fake-model", max_tokens=10, messages=[
            {"role": "user", "content": "go"}], extra_body={"thinking_budget": 5})
    assert error.value.body["param"] == "thinking_budget"
    assert "no thinking block" in error.value.body["message"]


async def test_qwen3_enable_thinking_false(serve, recipes):
    state, sdk = await serve(recipes["qwen3"], lambda p, o: "Straight </think> answer.")
    assert state.reasoning.name == "qwen3"
    reply = await sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (None, "Straight </think> answer.")
    prompt = recipes["qwen3"].decode(state.engine.added[0].prompt_token_ids,
                                     skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_qwen3_thinking_on_by_default(serve, recipes):
    _, sdk = await serve(recipes["qwen3"], lambda p, o: "<think>\nHm.\n</think>\n\nHello.")
    reply = await sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=30)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("Hm.", "Hello.")


async def test_history_reasoning_is_accepted_and_r1_drops_it(serve, recipes):
    state, sdk = await serve(recipes["r1"], r1_answer)
    await sdk.chat.completions.create(model="fake-model", max_tokens=50, messages=[
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "SECRET-THOUGHT"},
        {"role": "user", "content": "3+3?"}])
    prompt = recipes["r1"].decode(state.engine.added[0].prompt_token_ids,
                                  skip_special_tokens=False)
    assert "SECRET-THOUGHT" not in prompt
    assert prompt.endswith("<｜Assistant｜>Four.<｜end▁of▁sentence｜><｜User｜>3+3?"
                           "<｜Assistant｜><think>\n")


async def test_history_reasoning_is_dropped_where_the_template_has_no_place(make_harness):
    h = await make_harness()
    sdk = openai.AsyncOpenAI(base_url=h.base_url, api_key="none", max_retries=0)
    await sdk.chat.completions.create(model="fake-model", max_tokens=10, messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "SECRET"},
        {"role": "user", "content": "c"}])
    assert "SECRET" not in h.recipe.decode(h.engine.added[0].prompt_token_ids)


def test_unknown_or_unfit_parser_is_refused_at_start(recipes):
    from frontend_fakes import FakeEngineClient, FakeRecipe

    from duplex.frontend.server import AppState, ServerOptions
    with pytest.raises(ValueError, match="unknown reasoning parser 'r9'; choose one of "
                                         "deepseek_r1, qwen3"):
        ServerOptions(reasoning_parser="r9")
    with pytest.raises(ValueError, match="reasoning parser 'qwen3' does not fit this model"):
        AppState(FakeEngineClient(), FakeRecipe(), ServerOptions(reasoning_parser="qwen3"))
    state = AppState(FakeEngineClient(), recipes["qwen3"], ServerOptions(reasoning_parser="none"))
    assert state.reasoning is None


class ThinkingFakeRecipe:
    """FakeRecipe (one token per byte, so every marker is split across tokens) with a
    Qwen3-like template: the server detects the qwen3 parser."""

    def __new__(cls):
        from frontend_fakes import FakeRecipe
        recipe = FakeRecipe()
        recipe.template = ("{% if enable_thinking is defined and enable_thinking is false %}"
                           "<think>\n\n</think>\n\n{% endif %}")
        return recipe


async def test_markers_split_across_byte_tokens_never_leak_into_a_chunk(make_harness):
    from frontend_fakes import FakeEngineClient
    from aiohttp.test_utils import TestClient, TestServer

    from duplex.frontend.server import AppState, ServerOptions, build_app
    reply = "<think>\n<thin k> and </thinker> are not markers\n</think>\n\nYes </think> <think>"
    state = AppState(FakeEngineClient(reply=reply), ThinkingFakeRecipe(), ServerOptions())
    assert state.reasoning.name == "qwen3"
    client = TestClient(TestServer(build_app(state), host="127.0.0.1"))
    await client.start_server()
    try:
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none",
                                 max_retries=0)
        stream = await sdk.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "?"}], stream=True)
        reasoning, content = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
                content.append(choice.delta.content or "")
    finally:
        await client.close()
    assert "".join(reasoning) == "<thin k> and </thinker> are not markers"
    assert "".join(content) == "Yes </think> <think>"
    pieces = [p for p in reasoning + content if p]
    assert len(pieces) > 20  # streamed piece by piece, yet no piece holds a marker's start
    held = tuple("</think>"[:k] for k in range(1, 8))  # a reasoning piece never ends in one
    assert not any(p.endswith(held) for p in reasoning)

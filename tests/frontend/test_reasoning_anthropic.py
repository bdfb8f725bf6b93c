"""Reasoning in the Anthropic Messages API, through the official `anthropic` SDK: a `thinking`
content block before the text (streamed as thinking_delta events), `budget_tokens` as the
thinking budget, thinking blocks in history; bad budgets are 400s naming the field."""
from __future__ import annotations

import anthropic
import pytest
from reasoning_support import sdk_servers, anthropic_sdk


@pytest.fixture
async def serve():
    async with sdk_servers(anthropic_sdk) as make:
        yield make


def r1_answer(prompt: str, output: str) -> str:
    return "Two and two.\n</think>\n\nFour."


def budgeted(prompt: str, output: str) -> str:
    return "Answer." if "</think>" in output else "step " * 60


async def test_thinking_block_before_the_text(serve, recipes):
    _, sdk = await serve(recipes["r1"], r1_answer)
    message = await sdk.messages.create(model="fake-model", max_tokens=50, messages=[
        {"role": "user", "content": "2+2?"}])
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Two and two."
    assert message.content[1].text == "Four."
    assert message.stop_reason == "end_turn"


async def test_streamed_thinking_deltas(serve, recipes):
    _, sdk = await serve(recipes["r1"], r1_answer)
    kinds, thinking, text = [], [], []
    async with sdk.messages.stream(model="fake-model", max_tokens=50, messages=[
            {"role": "user", "content": "2+2?"}]) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thinking.append(event.delta.thinking)
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
        final = await stream.get_final_message()
    assert ("".join(thinking), "".join(text)) == ("Two and two.", "Four.")
    assert not any("<" in piece for piece in thinking + text)
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Two and two."
    starts = [k for k in kinds if k in ("content_block_start", "content_block_stop")]
    assert starts == ["content_block_start", "content_block_stop"] * 2


async def test_budget_tokens_closes_the_block(serve, recipes):
    state, sdk = await serve(recipes["r1"], budgeted)
    message = await sdk.messages.create(
        model="fake-model", max_tokens=40, messages=[{"role": "user", "content": "go"}],
        thinking={"type": "enabled", "budget_tokens": 3})
    assert message.content[0].thinking == "step step step"
    assert message.content[1].text == "Answer."
    assert len(state.engine.added) == 2


@pytest.mark.parametrize("thinking, param", [
    ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 41}, "thinking.budget_tokens"),
    ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "sometimes"}, "thinking.type"),
])
async def test_bad_thinking_is_a_400_naming_the_field(serve, recipes, thinking, param):
    _, sdk = await serve(recipes["r1"], budgeted)
    with pytest.raises(anthropic.BadRequestError) as error:
        await sdk.messages.create(model="fake-model", max_tokens=40, thinking=thinking,
                                  messages=[{"role": "user", "content": "go"}])
    assert param in error.value.body["error"]["message"]


async def test_thinking_disabled_turns_qwen3_thinking_off(serve, recipes):
    state, sdk = await serve(recipes["qwen3"], lambda p, o: "Plain answer.")
    message = await sdk.messages.create(model="fake-model", max_tokens=30,
                                        thinking={"type": "disabled"},
                                        messages=[{"role": "user", "content": "hi"}])
    assert [block.type for block in message.content] == ["text"]
    prompt = recipes["qwen3"].decode(state.engine.added[0].prompt_token_ids,
                                     skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_thinking_blocks_in_history_render_as_the_template_wants(serve, recipes):
    state, sdk = await serve(recipes["qwen3"], lambda p, o: "<think>\nx\n</think>\n\nDone.")
    await sdk.messages.create(model="fake-model", max_tokens=30, messages=[
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Two and two.",
                                           "signature": ""},
                                          {"type": "text", "text": "Four."}]},
        {"role": "user", "content": "ok"}])
    recipe = recipes["qwen3"]
    prompt = recipe.decode(state.engine.added[0].prompt_token_ids, skip_special_tokens=False)
    reference = recipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."},
         {"role": "user", "content": "ok"}], tokenize=False, add_generation_prompt=True)
    assert prompt == reference  # Qwen3 keeps reasoning only after the last user turn
    assert "Two and two." not in prompt

"""Reasoning in the Responses API, through the official `openai` SDK: a `reasoning` output
item before the message (streamed as response.reasoning_text.* events the SDK accumulates),
reasoning.effort as a thinking budget, reasoning items sent back in input."""
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


async def test_reasoning_item_before_the_message(serve, recipes):
    _, sdk = await serve(recipes["r1"], r1_answer)
    response = await sdk.responses.create(model="fake-model", input="2+2?",
                                          max_output_tokens=50)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Two and two."
    assert response.output_text == "Four."
    thinking_ids = recipes["r1"].encode_reply_start("Two and two.\n</think>")
    assert response.usage.output_tokens_details.reasoning_tokens == len(thinking_ids)


async def test_streamed_reasoning_events(serve, recipes):
    _, sdk = await serve(recipes["r1"], r1_answer)
    kinds, reasoning = [], []
    async with sdk.responses.stream(model="fake-model", input="2+2?",
                                    max_output_tokens=50) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                reasoning.append(event.delta)
                assert event.output_index == 0
            elif event.type == "response.output_text.delta":
                assert event.output_index == 1
        final = await stream.get_final_response()
    assert "".join(reasoning) == "Two and two."
    assert "response.reasoning_text.done" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Two and two."
    assert final.output_text == "Four."


async def test_reasoning_effort_is_a_budget(serve, recipes):
    state, sdk = await serve(recipes["r1"], lambda p, o: "Done." if "</think>" in o
                             else "step " * 60)
    response = await sdk.responses.create(model="fake-model", input="go",
                                          max_output_tokens=40, reasoning={"effort": "none"})
    assert response.output[0].content[0].text == "step"
    assert response.output_text == "Done."
    assert len(state.engine.added) == 2


async def test_reasoning_effort_without_a_thinking_model_is_a_400(make_harness):
    h = await make_harness()
    sdk = openai.AsyncOpenAI(base_url=h.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        await sdk.responses.create(model="fake-model", input="go", reasoning={"effort": "high"})
    assert error.value.body["param"] == "reasoning.effort"


async def test_reasoning_items_in_input_and_previous_response(serve, recipes):
    state, sdk = await serve(recipes["qwen3"], lambda p, o: "<think>\nHm.\n</think>\n\nOk.")
    first = await sdk.responses.create(model="fake-model", input="hi", max_output_tokens=30)
    await sdk.responses.create(model="fake-model", input="again", max_output_tokens=30,
                               previous_response_id=first.id)
    await sdk.responses.create(model="fake-model", max_output_tokens=30, input=[
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "message", "role": "assistant", "content": "Ok."},
        {"type": "message", "role": "user", "content": "again"}])
    second, third = state.engine.added[1:]
    assert second.prompt_token_ids == third.prompt_token_ids  # the same turn, both ways in

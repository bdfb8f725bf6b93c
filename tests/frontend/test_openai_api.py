"""OpenAI API against the official `openai` SDK (async client) and raw HTTP."""
from __future__ import annotations

import openai


def client_for(h, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.base_url, api_key=kw.pop("api_key", "none"),
                              max_retries=0, **kw)


async def test_chat_non_streaming_with_usage(harness):
    reply = await client_for(harness).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=50)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.content == "Hello there, friend!"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len("Hello there, friend!")
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
